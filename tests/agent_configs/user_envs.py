"""User environments for tests/test_agent_tools.py (loaded by tests/agent_configs/interactions.yaml).

Tests: tests/test_agent_tools.py
"""
from engine.agents.environments import Environment


class GuessInteraction(Environment):
    """Guess the secret number: reward 1 when guessed, done after max_tries."""

    def reset(self, prompt):
        self.tries = 0
        return f"Guess a number for: {prompt}"

    def step(self, action):
        self.tries += 1
        if action.strip() == str(self.config["secret"]):
            return "correct", 1.0, True
        done = self.tries >= self.config["max_tries"]
        return ("higher" if int(action) < self.config["secret"] else "lower"), 0.0, done


class EchoInteraction:
    """Not an Environment subclass, no config argument."""

    def step(self, action):
        return f"you said {action}", 0.0, False
