"""Which GPU (and Triton) a tuned table belongs to: what must match for its timings to hold."""
from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass
from ..versions import triton_version  # (tables record the version they were tuned under)


@dataclass(frozen=True)
class DeviceKey:
    """name: the driver's device name; arch: "sm_90" (CUDA) or "gfx942" (ROCm);
    sms: multiprocessors (compute units); triton: the Triton version that compiled the kernels."""

    name: str
    arch: str
    sms: int
    triton: str

    def same_gpu(self, other: "DeviceKey") -> bool:
        return (self.name, self.arch, self.sms) == (other.name, other.arch, other.sms)

    @property
    def slug(self) -> str:
        """A file-name-safe spelling, unique per key."""
        name = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        return f"{name}_{self.arch}_{self.sms}sm_triton-{self.triton}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data) -> "DeviceKey":
        if not isinstance(data, dict) or set(data) != {"name", "arch", "sms", "triton"}:
            raise ValueError(f"bad device key {data!r}")
        key = cls(str(data["name"]), str(data["arch"]), int(data["sms"]), str(data["triton"]))
        if not all((key.name, key.arch, key.triton)) or key.sms <= 0:
            raise ValueError(f"bad device key {data!r}")
        return key


@functools.lru_cache(maxsize=None)
def device_key(index: int) -> DeviceKey:
    """The key of CUDA/ROCm device `index` (queried once per process)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        arch = props.gcnArchName.split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
    else:
        arch = f"sm_{props.major}{props.minor}"
    return DeviceKey(props.name, arch, props.multi_processor_count, triton_version())


def current_device_index() -> int | None:
    """The current GPU's index, or None where no GPU is in use (kernels run on the CPU)."""
    import torch

    # is_initialized is free; any op that runs a kernel on the GPU has initialized CUDA.
    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()
