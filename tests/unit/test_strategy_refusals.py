"""Every decoding strategy against every per-request setting it does not honour: each is refused with a message that
names the setting and the strategy, so a request never runs with a setting that reaches no code. The strategy table
is read, not copied, so a strategy added later is held to the same rule."""

import pytest

from diffulex_backend import SamplingParams
from diffulex_backend.config import Config
from diffulex_backend.registry import STRATEGIES
from diffulex_backend.resolve import check_params

# A setting that only some strategies honour -> (a value that asks for it, whether a strategy's request honours it).
SETTINGS = {
    "retention_ratio": (0.5, lambda strategy: strategy.request_cls.SUPPORTS_PAGE_RETENTION),
    "sub_block_size": (4, lambda strategy: strategy.name == "fast_dllm_v2"),
    "edit_threshold": (0.5, lambda strategy: strategy.name == "dmax"),
    "remask_threshold": (0.5, lambda strategy: strategy.name not in ("fast_dllm_v2", "diffusion_gemma")),
}


def config_for(name: str) -> Config:
    # The smallest settings every strategy accepts: one block in flight, blocks of 8 (in sub-blocks of 4 where the
    # strategy has sub-blocks; elsewhere the setting keeps its default or is refused).
    sub_blocks = {"sub_block_size": 4} if "sub_block_size" in STRATEGIES.get(name).options else {}
    return Config(model="unused", decoding_strategy=name, buffer_size=1, block_size=8, **sub_blocks)


CASES = [(name, setting) for name in STRATEGIES.keys() for setting in SETTINGS]


@pytest.mark.parametrize("name, setting", CASES, ids=[f"{name}-{setting}" for name, setting in CASES])
def test_a_setting_a_strategy_does_not_honour_is_refused_by_name(name, setting):
    strategy = STRATEGIES.get(name)
    value, honoured = SETTINGS[setting]
    params = SamplingParams(**{setting: value})
    if honoured(strategy):
        check_params(params, config_for(name), strategy.request_cls)
        return
    with pytest.raises(ValueError, match=f"'{setting}'.*'{strategy.name}'") as caught:
        check_params(params, config_for(name), strategy.request_cls)
    assert caught.value.field == setting


@pytest.mark.parametrize("name", list(STRATEGIES.keys()))
def test_every_strategy_takes_a_request_with_the_default_settings(name):
    check_params(SamplingParams(), config_for(name), STRATEGIES.get(name).request_cls)
