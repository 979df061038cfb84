"""Test double of sglang's MultiprocessingSerializer: real sglang pickles a CUDA IPC handle of
the tensor; here the tensor travels by value, tagged with the rank that shared it, so the fake
engine can record whose copy each TP worker would have read."""
import io
import os
import pickle


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        buf = io.BytesIO()
        pickle.dump({"rank": int(os.environ.get("RANK", "0")), "obj": obj}, buf)
        return buf.getvalue()

    @staticmethod
    def deserialize(data):
        return pickle.loads(data)["obj"]

    @staticmethod
    def origin(data) -> int:
        return pickle.loads(data)["rank"]
