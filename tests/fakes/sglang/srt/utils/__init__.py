from sglang.srt.utils.common import MultiprocessingSerializer  # noqa: F401
