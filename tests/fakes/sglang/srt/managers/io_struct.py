"""Test double of the pause / continue requests of sglang/srt/managers/io_struct.py
(``PauseGenerationReqInput``: mode "abort" | "retract" | "in_place", default "abort";
``ContinueGenerationReqInput``: torch_empty_cache, default True). msgspec structs with
``kw_only=True`` there: keyword-only dataclasses here, refusing a mode sglang does not know."""
from dataclasses import dataclass

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"

    def __post_init__(self):
        if self.mode not in PAUSE_MODES:
            raise ValueError(f"PauseGenerationReqInput.mode={self.mode!r}: sglang takes {PAUSE_MODES}")


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True
