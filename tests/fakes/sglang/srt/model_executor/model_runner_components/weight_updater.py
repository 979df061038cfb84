"""Test double of sglang's LocalSerializedTensor: values[i] is TP rank i's serialized copy."""
from dataclasses import dataclass
from typing import List

from sglang.srt.utils.common import MultiprocessingSerializer


@dataclass
class LocalSerializedTensor:
    values: List[bytes]

    def get(self, rank: int):
        return MultiprocessingSerializer.deserialize(self.values[rank])
