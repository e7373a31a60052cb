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
    # It acts on the blocks after the first in flight: with one block in flight (config_for's) it reaches no code.
    "remask_threshold": (0.5, lambda strategy: False),
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


# The settings that act on the blocks after the first in flight, config fields and request parameters alike.
PAST_THE_FIRST_BLOCK = {"remask_threshold": 0.5, "add_block_threshold": 0.5, "semi_complete_threshold": 0.5}


@pytest.mark.parametrize("name", list(STRATEGIES.keys()))
def test_settings_past_the_first_block_act_only_where_a_step_predicts_several_blocks(name):
    strategy = STRATEGIES.get(name)
    several = strategy.request_cls.BLOCKS_IN_FLIGHT_SETTING is not None
    for setting, value in PAST_THE_FIRST_BLOCK.items():
        if setting != "remask_threshold" and setting not in strategy.options:
            continue  # another strategy's option: refused as such (Config._refuse_other_strategies_options)
        with pytest.raises(ValueError, match=f"config field '{setting}' must be .* for decoding_strategy '{name}'.*: "
                                             "it acts on the blocks after the first in flight"):
            Config(model="unused", decoding_strategy=name, block_size=8, **{setting: value})
        if several:  # two blocks in flight: taken, in the config and in a request
            config = Config(model="unused", decoding_strategy=name, block_size=8, buffer_size=2, **{setting: value})
            assert getattr(config, setting) == value
    if several:
        config = Config(model="unused", decoding_strategy=name, block_size=8, buffer_size=2)
        check_params(SamplingParams(remask_threshold=0.5), config, strategy.request_cls)
        assert name in ("multi_bd", "d2f", "dmax")  # the strategies with blocks in flight (buffer_size)
