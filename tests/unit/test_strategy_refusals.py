"""Every decoding strategy against every per-request setting it does not honour: each is refused with a message that
names the setting and the strategy, so a request never runs with a setting that reaches no code. The strategy table
is read, not copied, so a strategy added later is held to the same rule."""

import pytest

from diffulex_backend import SamplingParams
from diffulex_backend.config import Config
from diffulex_backend.registry import STRATEGIES
from diffulex_backend.resolve import check_mode_params, check_params
from diffulex_backend.sampling import SamplingMode

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


def modes_of(name: str) -> list[Config]:
    """config_for(name) in each sampling mode the strategy takes (fast_dllm_v2 and diffusion_gemma take the
    threshold only)."""
    configs = []
    for mode in SamplingMode:
        try:
            configs.append(Config(**{**config_for(name).__dict__, "sampling_mode": mode.value}))
        except ValueError as e:
            assert "'sampling_mode'" in str(e)
    assert configs
    return configs


# Each mode -> (the parameter it never reads, the one it reads), each with a value that asks for it.
MODE_PARAMETERS = {SamplingMode.TOPK: (("accept_threshold", 0.5), ("steps", 4)),
                   SamplingMode.THRESHOLD: (("steps", 4), ("accept_threshold", 0.5))}


@pytest.mark.parametrize("name", list(STRATEGIES.keys()))
def test_a_request_s_parameter_its_sampling_mode_never_reads_is_refused_by_name(name):
    request_cls = STRATEGIES.get(name).request_cls
    for config in modes_of(name):
        (unread, value), (read, read_value) = MODE_PARAMETERS[config.mode]
        with pytest.raises(ValueError, match=f"^sampling parameter '{unread}' does not apply in sampling_mode "
                                             f"'{config.sampling_mode}' \\(of decoding_strategy '{name}'\\)"):
            check_mode_params(SamplingParams(**{unread: value}), config)
        with pytest.raises(ValueError) as caught:  # through every check: the strategy's own refusal may come first
            check_params(SamplingParams(**{unread: value}), config, request_cls)
        assert caught.value.field == unread
        # The one the mode reads is taken, but by DiffusionGemma, whose sampler reads neither.
        try:
            check_params(SamplingParams(**{read: read_value}), config, request_cls)
        except ValueError as refusal:
            assert name == "diffusion_gemma" and refusal.field == read
            assert "does not apply in sampling_mode" not in str(refusal)


def test_head_select_is_refused_when_the_request_keeps_every_page_of_an_engine_that_drops_pages():
    config = Config(**{**config_for("multi_bd").__dict__, "retention_ratio": 0.5})
    request_cls = STRATEGIES.get("multi_bd").request_cls
    check_params(SamplingParams(head_select=False), config, request_cls)  # the engine's ratio, below 1: taken
    with pytest.raises(ValueError, match="'head_select' .* applies with a retention_ratio below 1 only \\(the "
                                         "request's, else the engine's setting\\); got False"):
        check_params(SamplingParams(head_select=False, retention_ratio=1), config, request_cls)


@pytest.mark.parametrize("name", list(STRATEGIES.keys()))
def test_the_accept_threshold_setting_is_refused_by_name_under_top_k_sampling(name):
    for config in modes_of(name):
        settings = {**config.__dict__, "accept_threshold": 0.5}
        if name == "diffusion_gemma":  # its sampler's acceptance is the checkpoint's entropy bound
            with pytest.raises(ValueError, match="config field 'accept_threshold' does not apply to "
                                                 "decoding_strategy 'diffusion_gemma'"):
                Config(**settings)
            continue
        if config.mode is SamplingMode.THRESHOLD:
            assert Config(**settings).accept_threshold == 0.5
            continue
        with pytest.raises(ValueError, match="config field 'accept_threshold' must be 0.9 with sampling_mode 'topk' "
                                             f"\\(decoding_strategy '{name}'\\): each step accepts the number of "
                                             "positions that 'steps' schedules; got 0.5"):
            Config(**settings)


@pytest.mark.parametrize("name", list(STRATEGIES.keys()))
def test_head_select_is_refused_by_name_where_a_request_keeps_every_page(name):
    strategy = STRATEGIES.get(name)
    config = config_for(name)
    keeps = ("the request's, else the engine's setting" if strategy.request_cls.SUPPORTS_PAGE_RETENTION else
             f"which decoding_strategy '{name}' keeps at 1: it does not drop pages")
    with pytest.raises(ValueError, match="sampling parameter 'head_select' ranks the pages a request keeps, and "
                                         f"applies with a retention_ratio below 1 only \\({keeps}\\)") as caught:
        check_params(SamplingParams(head_select=False), config, strategy.request_cls)
    assert caught.value.field == "head_select"
    if strategy.request_cls.SUPPORTS_PAGE_RETENTION:  # with a ratio below 1, the request's or the engine's: taken
        check_params(SamplingParams(head_select=False, retention_ratio=0.5), config, strategy.request_cls)
        engine_ratio = Config(**{**config.__dict__, "retention_ratio": 0.5, "head_select": False})
        check_params(SamplingParams(head_select=True), engine_ratio, strategy.request_cls)
    else:
        with pytest.raises(ValueError, match=f"config field 'head_select' must be true for decoding_strategy "
                                             f"'{name}', which keeps every page"):
            Config(**{**config.__dict__, "head_select": False})
