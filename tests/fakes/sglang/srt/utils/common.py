"""Test double of sglang's MultiprocessingSerializer: real sglang pickles a CUDA IPC handle of
the tensor; here the tensor travels by value, tagged with the rank that shared it, so the fake
engine can record whose copy each TP worker would have read. float8 tensors travel as their
bytes (torch's pickling of their storage does not load back)."""
import io
import os
import pickle


def _fp8(obj):
    import torch
    return isinstance(obj, torch.Tensor) and obj.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        import torch
        buf = io.BytesIO()
        if _fp8(obj):
            obj = {"float8": str(obj.dtype).removeprefix("torch."), "bytes": obj.contiguous().view(torch.uint8)}
        pickle.dump({"rank": int(os.environ.get("RANK", "0")), "obj": obj}, buf)
        return buf.getvalue()

    @staticmethod
    def deserialize(data):
        obj = pickle.loads(data)["obj"]
        if isinstance(obj, dict) and "float8" in obj:
            import torch
            return obj["bytes"].view(getattr(torch, obj["float8"]))
        return obj

    @staticmethod
    def origin(data) -> int:
        return pickle.loads(data)["rank"]
