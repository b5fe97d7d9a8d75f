"""flexplan: Triton sparse 3D convolution with cached execution plans and ahead-of-time kernels."""
from .cache import cached_plan, load_plans, plan_cache, save_plans
from .geometry import ConvGeometry
from .plan import PLAN_FORMAT_VERSION, ConvPlan, GatherMap
from .plan_provider import tensor_plan
from .planner import build_plan
from .sparse_tensor import SparseTensor, SparseTensorError

__all__ = ["ConvGeometry", "ConvPlan", "GatherMap", "PLAN_FORMAT_VERSION", "SparseTensor",
           "SparseTensorError", "build_plan", "cached_plan", "load_plans", "plan_cache", "save_plans",
           "tensor_plan"]
__version__ = "0.1.0"
