"""Training steps with the model's passes replayed from CUDA graphs (models.cuda_graphs) against the same steps run
eagerly, over batches whose shapes change from step to step."""
import copy
import math

import pytest
import torch

from data.dataset import Sample, collate
from data.text import NUM_CLASSES
from models.cuda_graphs import CudaGraphed
from prnn_kernels import relative_error
from test_trainer_units import compose_config
from trainer import build
from trainer.distributed import DistEnv
from trainer.train import train_step

NUM_FEATURES = 20
PAD_FRAMES = 50
# (utterances, frames of the longest): padded to 150, 100, 150, 150, 100 frames, so three graphs serve five steps.
SHAPES = [(4, 120), (4, 95), (4, 150), (3, 110), (4, 100)]


def random_batch(generator, batch_size, num_frames, nan=False):
    """Ragged utterances, the longest `num_frames` long, with 3-10 character targets."""
    others = torch.randint(num_frames // 2, num_frames + 1, (batch_size - 1,), generator=generator)
    lengths = [num_frames, *others.tolist()]
    samples = []
    for index, length in enumerate(lengths):
        features = torch.randn(length, NUM_FEATURES, generator=generator)
        if nan and index == 1:
            features[length // 2, 3] = math.nan
        target_length = int(torch.randint(3, 11, (1,), generator=generator))
        samples.append(Sample(features, torch.randint(1, NUM_CLASSES, (target_length,), generator=generator), index))
    return collate(samples)


def setup(cfg, device):
    torch.manual_seed(0)
    model = build.model(cfg.model, NUM_FEATURES).to(device)
    optimizer = build.optimizer(cfg.optim, model.parameters())
    return model, optimizer, build.lr_schedule(cfg.optim, optimizer, steps_per_epoch=100)


@pytest.fixture
def no_tf32():
    """fp32 convolutions in fp32: padding changes their shapes and so cuDNN's algorithm, which in TF32 alone moves
    the loss by ~1e-3."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


# Losses step by step, and the weights' change over all steps, which rounding differences grow into: one pass's
# fp32 gradients agree to ~2e-5 (H100), the first convolution's change after six steps to ~3e-3. A graph that
# replayed stale inputs, lost an update or left batch-norm statistics disturbed would be off by far more.
@pytest.mark.cuda
@pytest.mark.parametrize("amp, loss_tolerance, change_tolerance", [("none", 1e-4, 3e-2), ("bf16", 3e-2, 0.3)])
def test_graphed_steps_match_eager_steps(amp, loss_tolerance, change_tolerance, no_tf32):
    device = torch.device("cuda")
    # SGD: a step's update is linear in the gradient, so the weights compare the gradients themselves.
    cfg = compose_config(["model.depth=2", "model.hidden=64", "model.conv_channels=4", "model.backend=persistent",
                          "data.features.kind=mel", f"data.features.n_mels={NUM_FEATURES}", f"train.amp={amp}",
                          "optim=sgd", "optim.lr=1e-2", "optim.warmup_steps=0"])
    eager_model, eager_optimizer, eager_schedule = setup(cfg, device)
    model, optimizer, schedule = setup(cfg, device)
    initial = copy.deepcopy(model.state_dict())
    graphed = CudaGraphed(model, PAD_FRAMES, amp == "bf16")
    env = DistEnv(0, 1, 0, device)
    generator = torch.Generator().manual_seed(1)
    batches = [random_batch(generator, *shape) for shape in SHAPES]
    batches.insert(3, random_batch(generator, 4, 140, nan=True))  # reuses the 150-frame graph, skipped by both
    for step, batch in enumerate(batches):
        eager_outcome, eager_loss = train_step(eager_model, batch, eager_optimizer, eager_schedule, cfg, env)
        outcome, loss = train_step(graphed, batch, optimizer, schedule, cfg, env)
        assert outcome == eager_outcome
        if outcome == "ok":
            assert abs(loss - eager_loss) <= loss_tolerance * abs(eager_loss), (step, loss, eager_loss)
        else:
            assert math.isnan(loss) and math.isnan(eager_loss)
    assert graphed.num_graphs == 3
    for name, value in model.state_dict().items():
        eager_value = eager_model.state_dict()[name]
        if value.is_floating_point():
            # The change from the initial weights, so a wrong update cannot hide behind the weights' own size.
            start = initial[name].double()
            error = relative_error(value.double() - start, eager_value.double() - start)
            assert error <= change_tolerance, (name, error)
        else:
            assert torch.equal(value, eager_value), name


@pytest.mark.cuda
def test_graphs_refuse_a_cudnn_layer_with_the_reason():
    device = torch.device("cuda")
    cfg = compose_config(["model.depth=1", "model.hidden=32", "model.conv_channels=2", "model.backend=cudnn",
                          "data.features.kind=mel", f"data.features.n_mels={NUM_FEATURES}", "train.amp=none"])
    model, optimizer, schedule = setup(cfg, device)
    batch = random_batch(torch.Generator().manual_seed(0), 2, 60)
    with pytest.raises(ValueError, match="runs on cuDNN"):
        train_step(CudaGraphed(model, PAD_FRAMES, False), batch, optimizer, schedule, cfg, DistEnv(0, 1, 0, device))


def test_pad_frames_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="pad_frames must be a positive integer, not 0"):
        CudaGraphed(torch.nn.Linear(2, 2), 0, amp=False)
