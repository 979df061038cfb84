"""Built-in verifiable tasks for the tiny CPU demo: no downloads, a character-level tokenizer.

`arith`: prompts like "3+4=" whose answer ("7") the policy must emit, then stop (eos).
`copy`:  prompts like "47=" whose answer is the digits before "=" ("47").
`code`:  "write a Python function ..." prompts checked by asserts in the sandbox
         (data_source "code_asserts", engine/rewards/code.py); needs a real model's tokenizer
         (the character-level one has no letters).
`multiply`: "123*456=" -> "56088", beyond a tiny model's reach without a tool; its agent
         tokenizer (`build_agent_tokenizer`: printable ASCII, one character one token, plus the
         chat and tool-call special tokens) renders system / user / assistant / tool turns
         Hermes / Qwen style, so SFT on tool-using conversations (engine/data/sft.py
         `tool_conversations`) and a multi-turn rollout see the same tokens.

`difficulty` sets how hard it is to learn from random init:

    arith 0: a+b, a, b in 0..4          (answer one token: 0..8)
    arith 1: a+b, a, b in 0..9          (answer one or two tokens)
    arith 2: a+b or a-b, a, b in 0..99  (answer up to three tokens, may be negative)
    copy  d: a number with d+1 digits
    code  0: a one-line function; 1: a loop; 2: a small algorithm
    multiply d: two numbers of d+2 digits each

Rows follow the parquet prompt schema of engine/data/prompts.py; their `data_source` selects the
reward: for arith / copy the graded one of engine/rewards/arith.py (dense enough for GRPO to
rise from random init), for code the sandboxed tests.

Tests: tests/test_data.py, tests/test_rewards.py, tests/test_sandbox.py
"""
import random
import typing

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARACTERS = list("0123456789+-*= #")
# The template only prepends bos: the prompt text itself is the whole "conversation".
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"

BuiltinTask = typing.Literal["arith", "copy", "code", "multiply"]  # data.builtin_task (engine/config/schema.py)
BUILTIN_TASKS = typing.get_args(BuiltinTask)


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast over digits, + - * = space and '#'."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char, one token
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                        pad_token=PAD, unk_token=UNK, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# The agent tokenizer (task `multiply`): its own ids, the character-level one's stay as they are.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
AGENT_SPECIAL_TOKENS = [PAD, UNK, IM_START, IM_END]
AGENT_CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]
# Hermes / Qwen style turns. Each message renders on its own (a tool message is its own turn),
# so rendering messages[:k] is a prefix of rendering messages[:k+1] (engine/data/sft.py checks);
# an assistant turn is the generation prompt, its content, its tool calls, then eos (<|im_end|>).
AGENT_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}{% set f = call.function or call %}"
    "<tool_call>{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_agent_tokenizer():
    """One token per printable ASCII character (and newline), the chat tokens <|im_start|> and
    <|im_end|> (eos: a model turn ends there), the tool-call tags as added tokens that decoding
    keeps; no bos."""
    from tokenizers import AddedToken
    vocab = {token: i for i, token in enumerate(AGENT_SPECIAL_TOKENS + AGENT_CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m:.)"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
                                        unk_token=UNK, padding_side="left",
                                        additional_special_tokens=[IM_START])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.chat_template = AGENT_CHAT_TEMPLATE
    return tokenizer


def builtin_tokenizer(task):
    """The tokenizer of built-in task `task`: the agent one for `multiply`, else character-level."""
    return build_agent_tokenizer() if task == "multiply" else build_tokenizer()


def save_tokenizer(directory, task="arith"):
    """Write a built-in task's tokenizer so `AutoTokenizer.from_pretrained(directory)` loads it."""
    tokenizer = builtin_tokenizer(task)
    tokenizer.save_pretrained(directory)
    return tokenizer


def _arith_example(rng, difficulty):
    if difficulty == 0:
        a, b, op = rng.randint(0, 4), rng.randint(0, 4), "+"
    elif difficulty == 1:
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), "+"
    else:
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
    answer = a + b if op == "+" else a - b
    return f"{a}{op}{b}=", str(answer)


def _multiply_example(rng, difficulty):
    digits = difficulty + 2
    a, b = (rng.randint(10 ** (digits - 1), 10 ** digits - 1) for _ in range(2))
    return f"{a}*{b}=", str(a * b)


def _copy_example(rng, difficulty):
    digits = "".join(rng.choice("0123456789") for _ in range(difficulty + 1))
    return f"{digits}=", digits


# -- code ---------------------------------------------------------------------------------
_FIB = """def fib_mod(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % {m}
    return a
"""
_RLE = """def rle(s):
    out = []
    for ch in s:
        if out and out[-1][0] == ch:
            out[-1][1] += 1
        else:
            out.append([ch, 1])
    return "".join(c + str(n) for c, n in out)
"""


def _code_problems(rng, difficulty):
    """[(signature, what it does, reference source, input sampler)] of a level; the asserts
    come from running the reference, so they are right by construction."""
    k, m, c = rng.randint(2, 9), rng.randint(10, 97), rng.choice("abcde")

    def ints():
        return rng.randint(-50, 50)

    def word():
        return "".join(rng.choice("abcde") for _ in range(rng.randint(0, 8)))

    def naturals():
        return rng.randint(0, 300)

    return [
        [("add_k(x)", f"returns x plus {k}", f"def add_k(x):\n    return x + {k}\n", ints),
         ("times_k(x)", f"returns x multiplied by {k}", f"def times_k(x):\n    return x * {k}\n", ints),
         ("is_multiple(x)", f"returns True when x is divisible by {k}, else False",
          f"def is_multiple(x):\n    return x % {k} == 0\n", ints),
         ("repeat(s)", f"returns the string s repeated {k} times",
          f"def repeat(s):\n    return s * {k}\n", word)],
        [("count_char(s)", f"returns how many times the character {c!r} occurs in s",
          f"def count_char(s):\n    return sum(ch == {c!r} for ch in s)\n", word),
         ("sum_multiples(n)", f"returns the sum of the integers in 0..n-1 divisible by {k}",
          f"def sum_multiples(n):\n    return sum(range(0, n, {k}))\n", naturals),
         ("digit_sum(n)", "returns the sum of the decimal digits of the non-negative integer n",
          "def digit_sum(n):\n    return sum(int(d) for d in str(n))\n", naturals)],
        [("fib_mod(n)", f"returns the n-th Fibonacci number (fib_mod(0) == 0, fib_mod(1) == 1) "
          f"modulo {m}", _FIB.format(m=m), naturals),
         ("rle(s)", "returns the run-length encoding of s: each run of one character as the "
          "character followed by the run's length, e.g. rle('aab') == 'a2b1'", _RLE, word)],
    ][difficulty]


def _code_example(rng, difficulty):
    """(prompt, tests, entry point, reference solution) of one `code` problem."""
    signature, does, reference, sample = rng.choice(_code_problems(rng, difficulty))
    name = signature.split("(")[0]
    scope = {}
    exec(reference, scope)  # our own reference source, not model output
    inputs = []
    while len(inputs) < 5:
        value = sample()
        if value not in inputs:
            inputs.append(value)
    tests = "\n".join(f"assert {name}({x!r}) == {scope[name](x)!r}" for x in inputs)
    prompt = (f"Write a Python function `{signature}` that {does}. Reply with the function only, "
              "in a ```python code block.")
    return prompt, tests, name, reference


_GENERATORS = {"arith": _arith_example, "copy": _copy_example, "multiply": _multiply_example}


def make_rows(name, n, seed, difficulty=0, split="train"):
    """`n` rows of task `name` in the parquet prompt schema, reproducible from `seed`."""
    if name == "code":
        return _code_rows(n, seed, difficulty, split)
    if name not in _GENERATORS:
        raise ValueError(f"unknown built-in task {name!r}; choose one of {list(BUILTIN_TASKS)}")
    if difficulty not in (0, 1, 2):
        raise ValueError(f"difficulty={difficulty!r} for task {name!r}; choose 0, 1 or 2")
    rng = random.Random(f"{name}-{difficulty}-{split}-{seed}")
    rows = []
    for index in range(n):
        prompt, answer = _GENERATORS[name](rng, difficulty)
        rows.append({
            "data_source": name,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "difficulty": difficulty},
        })
    return rows


def _code_rows(n, seed, difficulty, split):
    if difficulty not in (0, 1, 2):
        raise ValueError(f"difficulty={difficulty!r} for task 'code'; choose 0, 1 or 2")
    rng = random.Random(f"code-{difficulty}-{split}-{seed}")
    rows = []
    for index in range(n):
        prompt, tests, entry_point, reference = _code_example(rng, difficulty)
        rows.append({
            "data_source": "code_asserts",
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": tests},
            "extra_info": {"split": split, "index": index, "difficulty": difficulty,
                           "entry_point": entry_point, "reference": reference},
        })
    return rows


def make_builtin_task(name="arith", seed=0, n_train=1024, n_val=128, difficulty=0):
    """(train rows, val rows, tokenizer) for a built-in task; the splits use separate streams."""
    train = make_rows(name, n_train, seed, difficulty, split="train")
    val = make_rows(name, n_val, seed, difficulty, split="test")
    return train, val, builtin_tokenizer(name)
