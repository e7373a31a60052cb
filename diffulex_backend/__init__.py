"""diffulex_backend: a serving engine for diffusion language models (LLaDA, Dream, SDAR)."""
from .source_tree import check_kernels_beside_engine

check_kernels_beside_engine()  # before any module below imports a kernel

from .config import Config  # noqa: E402
from .sampling import SamplingMode  # noqa: E402
from .engine import DiffulexEngine, EngineMetrics  # noqa: E402
from .output import RequestOutput, StepOutput  # noqa: E402
from .request import FinishReason, RequestStatus  # noqa: E402
from .sampling import Confidence, SamplingParams  # noqa: E402

Diffulex = DiffulexEngine

__all__ = [
    "Confidence", "Config", "Diffulex", "DiffulexEngine", "EngineMetrics", "FinishReason",
    "RequestOutput", "RequestStatus", "SamplingMode", "SamplingParams", "StepOutput",
]
