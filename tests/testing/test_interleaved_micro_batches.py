"""interleaved_1f1b with m not a multiple of p (torch's "flex" order: one round of m < 2p, or equal
rounds longer than p), interpreted in one process (no Ray), trains exactly as one plain PyTorch
process does; the m it cannot run are refused before any worker starts, naming the rule."""
import pytest
import torch
from torch import nn

import raypipe
from raypipe.errors import ConfigError
from raypipe.testing.op_interpreter import OpInterpreter
from tests.reference import adamw, assert_parameters_match, random_batches, reference_step

STEPS, CLIP = 2, 0.1


def deep_mlp(seed: int = 0) -> nn.Sequential:
    """Eight layers, so that four workers hold two chunks each."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Linear(16, 4))


@pytest.mark.parametrize("mode", [{"activation_checkpoint": "never"}, {"activation_checkpoint": "always"}],
                         ids=lambda mode: mode["activation_checkpoint"])
@pytest.mark.parametrize("num_stages,micro_batches,virtual_stages", [(4, 6, 2), (4, 3, 2), (4, 5, 2), (2, 3, 2),
                                                                     (2, 3, 4), (3, 4, 2), (4, 10, 2),
                                                                     (4, 15, 2), (3, 8, 2)])
def test_interleaved_m_not_a_multiple_of_p_trains_as_one_process(num_stages, micro_batches, virtual_stages, mode):
    """Every step's loss and grad norm (the global clip acting) and then every parameter equal one
    process accumulating the same micro-batches; virtual_stages left unset is interleaved's 2."""
    config = raypipe.PipelineConfig(num_stages=num_stages, num_micro_batches=micro_batches, schedule="interleaved_1f1b",
                                    clip_grad_norm=CLIP, **mode,
                                    **({} if virtual_stages == 2 else {"virtual_stages": virtual_stages}))
    assert config.virtual_stages == virtual_stages
    pipeline = OpInterpreter(list(deep_mlp()), nn.functional.mse_loss, adamw, config)
    model = deep_mlp()
    optimizer = adamw(model.parameters())
    for step, (x, y) in enumerate(random_batches(2 * micro_batches, STEPS)):
        decision = pipeline.step(step, x, y)
        loss, norm = reference_step(model, optimizer, nn.functional.mse_loss, x, y, micro_batches, CLIP)
        assert not decision.skipped
        torch.testing.assert_close(decision.loss, loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(decision.grad_norm, norm, rtol=1e-5, atol=0)
        assert norm > CLIP
    assert_parameters_match(pipeline.state_dict(), model.state_dict())


@pytest.mark.parametrize("micro_batches,why", [(9, "9 does not split into 2 equal rounds"),
                                               (14, "14 does not split into 3 equal rounds")])
def test_an_m_interleaved_cannot_run_is_refused_naming_the_rule(micro_batches, why):
    config = raypipe.PipelineConfig(num_stages=4, num_micro_batches=micro_batches, schedule="interleaved_1f1b")
    with pytest.raises(ConfigError) as error:
        OpInterpreter(list(deep_mlp()), nn.functional.mse_loss, adamw, config)
    first = str(error.value).splitlines()[0]
    assert first.startswith(f"invalid num_micro_batches={micro_batches}: per replica: interleaved_1f1b needs m "
                            "micro-batches that split into max(1, m // p) equal rounds (the rule of torch's "
                            "ScheduleInterleaved1F1B)")
    assert why in first
