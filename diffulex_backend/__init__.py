"""diffulex_backend: a serving engine for diffusion language models (LLaDA, Dream, SDAR)."""
from .config import Config
from .sampling import SamplingMode
from .engine import DiffulexEngine, EngineMetrics
from .output import RequestOutput, StepOutput
from .request import FinishReason, RequestStatus
from .sampling import Confidence, SamplingParams

Diffulex = DiffulexEngine

__all__ = [
    "Confidence", "Config", "Diffulex", "DiffulexEngine", "EngineMetrics", "FinishReason",
    "RequestOutput", "RequestStatus", "SamplingMode", "SamplingParams", "StepOutput",
]
