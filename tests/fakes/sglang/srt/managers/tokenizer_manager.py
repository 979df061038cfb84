"""Test double of the pause / continue half of sglang/srt/managers/tokenizer_manager.py
``TokenizerManager`` (0.5.21): ``async pause_generation(obj)`` sets ``is_pause`` and, for "retract"
and "in_place", dispatches the request to the scheduler (sglang/srt/managers/scheduler.py
``Scheduler.pause_generation``: "retract" puts every running request back in the waiting queue
with its KV freed, so it is prefilled again, prefix included, with the weights loaded meanwhile);
"abort" aborts every request instead. ``async continue_generation(obj)`` clears ``is_pause`` and
dispatches. (While paused, sglang's new generate requests wait on ``is_pause_cond``.)"""


class TokenizerManager:
    def __init__(self, record):
        self.is_pause = False
        self._record = record  # the double's event log (tests/fakes/sglang/__init__.py _record)

    async def pause_generation(self, obj):
        self.is_pause = True
        self._record("pause_generation", mode=obj.mode)

    async def continue_generation(self, obj):
        self.is_pause = False
        self._record("continue_generation", torch_empty_cache=obj.torch_empty_cache)
