"""Test double of the pause / continue half of sglang/srt/managers/tokenizer_manager.py
``TokenizerManager`` (0.5.21) and of what each pause mode does to the requests in flight
(sglang/srt/managers/scheduler.py ``Scheduler.pause_generation`` / ``abort_request``):

* ``generate_request`` waits on ``is_pause_cond`` until ``is_pause`` is False, then holds
  ``model_update_lock``'s reader side until its results are back (`admit` / `release` here);
* ``pause_generation(mode="abort")`` sets ``is_pause`` and repeats ``abort_request(abort_all=True)``
  until no request holds the reader lock (sglang sleeps 1.0 s between tries; here a few ms). A
  running request gets ``to_finish = FINISH_ABORT()``, runs one more decode step and returns the
  tokens it has with finish_reason ``FINISH_ABORT().to_json()`` (``to_finish`` beats the stop-token
  and length checks: sglang/srt/managers/schedule_batch.py ``Req.update_finish_state``); one
  still in the waiting queue returns no tokens with ``{"type": "abort", "message": "Abort in
  waiting queue"}`` (``TokenizerManager._handle_abort_req``). Neither has a status_code, so
  Engine.async_generate returns them (``_handle_abort_finish_reason`` raises only for 400 / 500 / 503);
* ``mode="retract"`` / ``"in_place"`` dispatch to the scheduler, which stops decoding and keeps the
  requests: retract frees their KV and prefills prompt + tokens again on continue (with the
  weights loaded meanwhile), in_place keeps their KV. Their results come when they end, one
  response each, with no mark of where the pause fell;
* ``continue_generation(obj)`` clears ``is_pause`` and dispatches (the scheduler decodes again).

The scheduler's side runs in the engine's worker thread (`Request.step`, asked by the CPU
backend after each decoded token: tests/fakes/sglang/srt/sampling/sampling_batch_info.py)."""
import asyncio
import threading

POLL_S = 0.005  # sglang's abort loop sleeps 1.0 s between tries: only the wait differs
PAUSED_WAIT_S = 20.0
RUNNING_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT()
WAITING_ABORT = {"type": "abort", "message": "Abort in waiting queue"}  # _handle_abort_req


class Request:
    """One generate request past the pause gate (model_update_lock's reader side)."""

    def __init__(self, manager):
        self.manager = manager
        self.abort = threading.Event()  # abort_request(abort_all=True) reached it
        self.calls = 0  # decode steps of the current scheduler run

    def step(self) -> bool:
        """The scheduler after a decoded token: True stops the request there (aborted; or, under
        retract, put back in the waiting queue); under in_place it waits here, KV kept."""
        self.calls += 1
        if self.manager.step_hook is not None:  # a test holding the scheduler at a token
            self.manager.step_hook(self)
        if self.abort.is_set():
            return True
        m = self.manager
        if not m.resumed.is_set():
            if m.mode == "retract":
                return True
            m.resumed.wait()  # in_place: decoding goes on with its KV after continue
        return self.abort.is_set()


class TokenizerManager:
    def __init__(self, record):
        self.is_pause = False
        self.mode = None
        self.resumed = threading.Event()  # the scheduler decodes (not paused in retract / in_place)
        self.resumed.set()
        self.in_flight = []
        self.step_hook = None  # tests: called with the Request after each decoded token (the scheduler's thread)
        self._record = record  # the double's event log (tests/fakes/sglang/__init__.py _record)

    async def admit(self) -> Request:
        """generate_request: wait while paused, then hold the reader lock (`release` gives it back).
        sglang waits for continue_generation without end; the double raises after PAUSED_WAIT_S."""
        waited = 0.0
        while self.is_pause:
            if waited > PAUSED_WAIT_S:
                raise RuntimeError(f"a request waited {PAUSED_WAIT_S:.0f} s for continue_generation after "
                                   f"pause_generation(mode={self.mode!r}): sglang would wait forever")
            await asyncio.sleep(POLL_S)
            waited += POLL_S
        request = Request(self)
        self.in_flight.append(request)
        return request

    def release(self, request):
        self.in_flight.remove(request)

    async def pause_generation(self, obj):
        self.is_pause = True
        self.mode = obj.mode
        self._record("pause_generation", mode=obj.mode)
        if obj.mode != "abort":  # the scheduler stops decoding and keeps its requests
            self.resumed.clear()
            return
        while True:  # abort_request(abort_all=True) until model_update_lock is free
            for request in self.in_flight:
                request.abort.set()
            if not self.in_flight:
                return
            await asyncio.sleep(POLL_S)

    async def continue_generation(self, obj):
        self.is_pause = False
        self.mode = None
        self.resumed.set()
        self._record("continue_generation", torch_empty_cache=obj.torch_empty_cache)
