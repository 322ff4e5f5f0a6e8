"""What AppConfig fills in: max_model_len from the target's own context, as vLLM does."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments.config import AppConfig


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
