"""The layout rules have one owner, parallel/mesh.py (`Layout.check`): the recipe's layout
messages (engine/config/layout_check.py) and the tools' are its errors, named in the caller's
vocabulary; nothing else decides whether a layout tiles a world or fits a model."""
import pytest

from engine.config import ConfigError, derive, load_config, validate_layout
from engine.config.devices import layout_of
from engine.config.layout_check import MEGATRON_NAMES
from parallel.mesh import Layout, LayoutError

from tests.test_config import DEMO, MEG


def _error(fn, *args, **kwargs):
    with pytest.raises(ValueError) as e:
        fn(*args, **kwargs)
    return e.value


@pytest.mark.parametrize("layout, world, shape, size, text", [
    (Layout(tp=3), 4, {}, "tp", "tp=3: does not divide world size 4; use 1, 2 or 4"),
    (Layout(tp=2, pp=4), 4, {}, "pp", "pp=4: does not divide world size 4 with tp=2 (2 ranks left for it)"),
    (Layout(tp=2, ep=2, etp=2), 2, {}, "ep", "ep=2: ep x etp = 2 x 2 must divide world size 2 / pp 1 = 2"),
    (Layout(vpp=2), 2, {}, "vpp", "vpp=2: interleaving needs pp > 1"),
    (Layout(sequence_parallel=True), 2, {}, "sequence_parallel", "sequence_parallel=True: needs tp > 1"),
    (Layout(tp=2), 2, {"num_attention_heads": 3}, "tp", "must divide the model's 3 attention heads"),
    (Layout(tp=2), 2, {"num_experts": 4}, "sequence_parallel", "an MoE model (4 experts) with tp=2"),
    (Layout(ep=2), 2, {"num_experts": 0}, "ep", "ep=2: the model is dense"),
    (Layout(), 0, {}, "world_size", "world_size=0: must be a positive int"),
])
def test_the_rules_speak_layout_names_by_default(layout, world, shape, size, text):
    e = _error(layout.check, world, **shape)
    assert isinstance(e, LayoutError) and e.size == size and text in str(e)


def test_valid_layouts_pass_and_world_size_defaults_to_the_layouts():
    Layout(tp=2, pp=2, vpp=2).check(8, num_layers=4)
    Layout(tp=2, ep=2, etp=1, sequence_parallel=True).check(4, num_experts=8, num_layers=2)
    Layout(tp=2, world_size=4).check()
    with pytest.raises(LayoutError, match="world size 2"):
        Layout(tp=4, world_size=2).check()


BAD = [  # (world, overrides, model shape) the recipe's layout refuses
    (4, [f"{MEG}.tensor_model_parallel_size=3"], {}),
    (4, [f"{MEG}.tensor_model_parallel_size=2", f"{MEG}.pipeline_model_parallel_size=4"], {}),
    (4, [f"{MEG}.pipeline_model_parallel_size=2", f"{MEG}.expert_model_parallel_size=4"], {}),
    (2, [f"{MEG}.virtual_pipeline_model_parallel_size=2"], {}),
    (4, [f"{MEG}.pipeline_model_parallel_size=4"], {"num_layers": 6}),
    (2, [f"{MEG}.sequence_parallel=true"], {}),
    (2, [f"{MEG}.tensor_model_parallel_size=2"], {"num_experts": 4}),
    (2, [f"{MEG}.tensor_model_parallel_size=2"], {"num_attention_heads": 3, "num_query_groups": 3}),
]


@pytest.mark.parametrize("world, overrides, shape", BAD)
def test_the_recipes_layout_errors_are_the_mesh_rules_named_by_key(world, overrides, shape):
    cfg = load_config(DEMO, [f"trainer.n_gpus_per_node={world}", *overrides])
    mesh = _error(layout_of(cfg, world).check, world, names=MEGATRON_NAMES, **shape)
    config = _error(validate_layout, cfg, world, **shape)
    assert isinstance(config, ConfigError)
    assert str(config) == f"{MEG}.{MEGATRON_NAMES[mesh.size]}={mesh.value!r}: {mesh.fix}"


def test_a_rule_planted_in_the_mesh_reaches_the_recipe_and_derive(monkeypatch):
    """validate_layout and derive ask Layout.check: a rule added there is the recipe's at once."""
    def planted(self, world_size=None, **kwargs):
        raise LayoutError("cp", self.cp, "a planted rule", kwargs.get("names"))
    monkeypatch.setattr(Layout, "check", planted)
    cfg = load_config(DEMO)
    expected = f"{MEG}.context_parallel_size=1: a planted rule"
    assert str(_error(validate_layout, cfg, 2)) == expected
    assert str(_error(derive, cfg, 2)) == expected
