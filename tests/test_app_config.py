"""What AppConfig fills in (max_model_len from the target's own context, as vLLM does) and what it refuses."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig, LaneConfig


def test_max_model_len_defaults_to_the_targets_context_and_an_explicit_value_wins(pair_paths):
    target, draft = pair_paths
    context = json.loads((Path(target) / "config.json").read_text())["max_position_embeddings"]
    models = {"target": {"path": target}, "draft": {"path": draft}}
    assert AppConfig(mode="unified", **models).engine.max_model_len == context
    assert AppConfig(mode="unified", **models).engine.engine_config("unified").max_model_len == context
    assert AppConfig(mode="unified", engine={"max_model_len": 96}, **models).engine.max_model_len == 96


def test_an_unreadable_target_config_asks_for_max_model_len(tmp_path):
    with pytest.raises(ValidationError, match="set engine.max_model_len"):
        AppConfig(mode="nospec", target={"path": str(tmp_path)})  # a directory with no config.json


def test_cuda_graphs_can_be_turned_off_by_config(pair_paths):
    target, draft = pair_paths
    models = {"target": {"path": target}, "draft": {"path": draft}}
    assert AppConfig(mode="spec", **models).engine.engine_config("spec").cuda_graphs is None  # on where CUDA is
    off = AppConfig(mode="spec", engine={"cuda_graphs": False}, **models)
    assert off.engine.engine_config("spec").cuda_graphs is False


def test_a_lanes_custom_resources_go_to_its_actor_and_each_rank_and_rays_own_names_are_refused():
    lane = LaneConfig(num_cpus=0.5, num_gpus=1, resources={"verify_node": 1})
    opts = lane.deployment_options(tensor_parallel_size=2)
    assert opts["ray_actor_options"]["resources"] == {"verify_node": 1}
    assert opts["placement_group_bundles"] == [{"CPU": 0.5, "GPU": 1, "verify_node": 1}] * 2
    assert "resources" not in LaneConfig().deployment_options()["ray_actor_options"]
    for wrong in ({"GPU": 1}, {"verify_node": 0}):
        with pytest.raises(ValidationError, match="resources"):
            LaneConfig(resources=wrong)


def test_draft_quantization_reaches_every_lane_engine_but_not_nospec(pair_paths):
    from deployments.factories import _engine_config

    target, draft = pair_paths
    models = {"target": {"path": target}, "draft": {"path": draft, "quantization": "int8"}}
    for mode in ("unified", "pdv"):
        cfg = AppConfig(mode=mode, **models)
        for lane in (cfg.decode_lane, cfg.prefill_lane):
            assert _engine_config(cfg, lane, "lane").draft_quantization == "int8", (mode, lane)
    nospec = AppConfig(mode="nospec", **models)  # loads no draft
    assert _engine_config(nospec, nospec.decode_lane, "lane").draft_quantization is None
