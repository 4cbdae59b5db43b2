"""Every invalid config raises a ConfigError naming the field, the value and what is allowed."""
import pytest

from raypipe import ConfigError, PipelineConfig


@pytest.mark.parametrize("changes,num_layers,field", [
    ({"num_stages": 0}, 4, "num_stages"),
    ({"num_stages": 5}, 4, "num_stages"),
    ({"num_stages": 2.0}, 4, "num_stages"),
    ({"num_micro_batches": 0}, 4, "num_micro_batches"),
    ({"schedule": "zigzag"}, 4, "schedule"),
    ({"checkpoint": "sometimes"}, 4, "checkpoint"),
    ({"precision": "fp8"}, 4, "precision"),
    ({"transport": "carrier-pigeon"}, 4, "transport"),
    ({"clip_grad_norm": 0.0}, 4, "clip_grad_norm"),
    ({"clip_grad_norm": -1}, 4, "clip_grad_norm"),
    ({"clip_grad_value": 0}, 4, "clip_grad_value"),
    ({"num_stages": 2, "balance": [4]}, 4, "balance"),
    ({"num_stages": 2, "balance": [1, 2]}, 4, "balance"),
    ({"num_stages": 2, "balance": [4, 0]}, 4, "balance"),
    ({"checkpoint_segments": 0}, 4, "checkpoint_segments"),
    ({"offload": True}, 4, "offload"),
    ({"metrics_port": 70000}, 4, "metrics_port"),
    ({"placement_timeout_s": 0}, 4, "placement_timeout_s"),
    ({"min_loss_scale": 0}, 4, "min_loss_scale"),
    ({"growth_interval": 0}, 4, "growth_interval"),
])
def test_invalid_config_names_field_value_and_allowed(changes, num_layers, field):
    config = PipelineConfig(**changes)
    with pytest.raises(ConfigError) as error:
        config.validate(num_layers)
    assert error.value.field == field
    message = str(error.value)
    assert field in message and repr(error.value.value) in message
    assert error.value.allowed and error.value.allowed in message


def test_valid_configs_pass():
    PipelineConfig().validate(1)
    PipelineConfig(num_stages=2, num_micro_batches=8, balance=[3, 1], checkpoint="always", offload=True,
                   clip_grad_norm=1.0, precision="fp16", schedule="1f1b").validate(4)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="num_stagez"):
        PipelineConfig.from_dict({"num_stagez": 2})
    assert PipelineConfig.from_dict({"num_stages": 2}).num_stages == 2
