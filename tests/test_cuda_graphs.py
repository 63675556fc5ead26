"""Training steps with the model's passes replayed from CUDA graphs (models.cuda_graphs) against the same steps run
eagerly, over batches whose shapes change from step to step."""
import copy
import gc
import math

import pytest
import torch

from data.dataset import Sample, collate
from data.text import NUM_CLASSES
from models.cuda_graphs import CudaGraphed, check_capturable, collector_paused
from prnn_kernels import GRU, relative_error
from prnn_kernels.persistent import support
from conftest import compose_config
from trainer import build
from trainer.distributed import DistEnv
from trainer.step import train_step

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


def difference(actual, expected):
    """relative_error, and where `expected` is all zeros (a skipped step's update) 0 if `actual` is too, else inf."""
    if not expected.any():
        return math.inf if actual.any() else 0.0
    return relative_error(actual, expected)


def graphed_against_eager(amp, seed, model_overrides=()):
    """Training steps on the graphed model and on an eager twin, each step started from the eager run's weights,
    batch-norm statistics and momentum, so that one step's rounding cannot compound into the next: the training
    dynamics amplify it (from 1e-6 to 1e-3 in the loss within three steps, for some seeds). Yields, per step, both
    outcomes and losses, the relative error of every parameter's update and of every buffer after the step.
    `model_overrides` change the model from two bidirectional GRU layers on the persistent kernels."""
    device = torch.device("cuda")
    # SGD: a step's update is linear in the gradient, so the updates compare the gradients themselves.
    cfg = compose_config(["model.depth=2", "model.hidden=64", "model.conv_channels=4", "model.backend=persistent",
                          "data.features.kind=mel", f"data.features.n_mels={NUM_FEATURES}", f"train.amp={amp}",
                          "optim=sgd", "optim.lr=1e-2", "optim.warmup_steps=0", *model_overrides])
    eager_model, eager_optimizer, eager_schedule = setup(cfg, device)
    model, optimizer, schedule = setup(cfg, device)
    graphed = CudaGraphed(model, PAD_FRAMES, amp == "bf16")
    env = DistEnv(0, 1, device)
    generator = torch.Generator().manual_seed(seed)
    batches = [random_batch(generator, *shape) for shape in SHAPES]
    batches.insert(3, random_batch(generator, 4, 140, nan=True))  # reuses the 150-frame graph, skipped by both
    for batch in batches:
        model.load_state_dict(eager_model.state_dict())  # copies in place: the graphs keep their parameters
        optimizer.load_state_dict(copy.deepcopy(eager_optimizer.state_dict()))  # its momentum, not an alias of it
        start = {name: value.detach().double() for name, value in model.named_parameters()}
        eager = train_step(eager_model, batch, eager_optimizer, eager_schedule, cfg, env)
        graph = train_step(graphed, batch, optimizer, schedule, cfg, env)
        eager_parameters = dict(eager_model.named_parameters())
        update_errors = {name: difference(value.detach().double() - start[name],
                                          eager_parameters[name].detach().double() - start[name])
                         for name, value in model.named_parameters()}
        eager_buffers = dict(eager_model.named_buffers())
        buffer_errors = {name: difference(value.double(), eager_buffers[name].double())
                         for name, value in model.named_buffers() if value.is_floating_point()}
        yield eager, graph, update_errors, buffer_errors
    # One pair of graphs per (batch size, frames padded to 50): the 95- and 100-frame batches share one, as do the
    # 120-, 140- and 150-frame batches of 4.
    assert graphed._graphed.keys() == {(4, 100), (4, 150), (3, 150)}


# Margins seen on an H100 over five seeds: fp32 losses within 1.4e-7, updates 7e-5, batch-norm statistics 2.5e-7; bf16
# losses equal, updates within 1.5e-3 (bf16 roundings that the padding's different sums tip). A graph that replayed
# stale inputs, lost an update or left batch-norm statistics disturbed would be off by far more.
TOLERANCES = {"none": {"loss": 1e-5, "update": 1e-3}, "bf16": {"loss": 1e-3, "update": 3e-2}}


def assert_graphed_steps_match_eager_steps(amp, model_overrides=()):
    tolerance = TOLERANCES[amp]
    steps = graphed_against_eager(amp, seed=1, model_overrides=model_overrides)
    for step, (eager, graph, update_errors, buffer_errors) in enumerate(steps):
        (eager_outcome, eager_loss, *_), (outcome, loss, *_) = eager, graph
        assert outcome == eager_outcome, step
        if outcome == "ok":
            assert abs(loss - eager_loss) <= tolerance["loss"] * abs(eager_loss), (step, loss, eager_loss)
        else:
            assert math.isnan(loss) and math.isnan(eager_loss)
        # Each error held to its bound (not the largest: max() passes a NaN that is not first).
        bad_updates = {name: error for name, error in update_errors.items() if not error <= tolerance["update"]}
        assert not bad_updates, (step, bad_updates)
        bad_buffers = {name: error for name, error in buffer_errors.items() if not error <= 1e-5}
        assert not bad_buffers, (step, bad_buffers)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", TOLERANCES)
def test_graphed_steps_match_eager_steps(amp, no_tf32):
    assert_graphed_steps_match_eager_steps(amp)


# The models the trainer can capture besides the default's two bidirectional GRU layers: each changes what the graphs
# hold (the lookahead convolution, residual sums, one layer and no batch norm between layers, the cells' other states
# and kernels, slices of 2 whose last is short at batch 3, the reference recurrence's per-step kernels), and
# experiment=deep100's residual stack in bf16.
@pytest.mark.cuda
@pytest.mark.parametrize("amp, model_overrides", [
    ("none", ["model.bidirectional=false"]),
    ("none", ["model.depth=3", "model.residual=true"]),
    ("bf16", ["model.depth=3", "model.residual=true"]),
    ("none", ["model.depth=1"]),
    ("none", ["model.cell=lstm"]),
    ("none", ["model.cell=relu", "model.batch_slice=2"]),
    ("none", ["model.cell=tanh", "model.bidirectional=false", "model.batch_slice=3"]),
    ("none", ["model.backend=reference"]),
], ids=lambda value: ",".join(value) if isinstance(value, list) else value)
def test_graphed_steps_of_other_models_match_eager_steps(amp, model_overrides, no_tf32):
    assert_graphed_steps_match_eager_steps(amp, model_overrides)


@pytest.mark.cuda
def test_the_graphed_model_gives_the_models_outputs_and_evaluates_eagerly(no_tf32):
    """Training mode replays graphs of the batch padded to 150 frames and returns the model's own frames; evaluation
    mode runs the model itself, with its running statistics, and captures nothing."""
    device = torch.device("cuda")
    cfg = compose_config(["model.depth=2", "model.hidden=64", "model.conv_channels=4", "model.backend=persistent",
                          "data.features.kind=mel", f"data.features.n_mels={NUM_FEATURES}", "train.amp=none"])
    model, _, _ = setup(cfg, device)
    graphed = CudaGraphed(model, PAD_FRAMES, amp=False)
    batch = random_batch(torch.Generator().manual_seed(3), 4, 120)
    features, lengths = batch.features.to(device), batch.feature_lengths.to(device)
    for mode in ("train", "eval"):
        getattr(graphed, mode)()
        log_probs, out_lengths = graphed(features, lengths)
        expected, expected_lengths = model(features, lengths)
        assert log_probs.shape == expected.shape and torch.equal(out_lengths, expected_lengths), mode
        valid = torch.arange(expected.shape[0], device=device)[:, None] < expected_lengths[None, :]
        assert relative_error(log_probs[valid].double(), expected[valid].double()) <= 1e-5, mode
    assert graphed._graphed.keys() == {(4, 150)}


@pytest.mark.cuda
def test_a_layer_that_runs_persistent_only_in_bf16_is_captured_under_bf16_autocast():
    """The capture asks each layer's backend at the dtype the graphs run in: a GRU of 3072 units fits on chip in bf16,
    not in fp32, where backend auto would run cuDNN, which a graph cannot hold."""
    device = torch.device("cuda")
    assert support("gru", 3072, 4, torch.bfloat16, device).ok and not support("gru", 3072, 4, torch.float32, device).ok
    cfg = compose_config(["model.depth=1", "model.hidden=3072", "model.bidirectional=false", "model.conv_channels=2",
                          "model.backend=auto", "data.features.kind=mel", f"data.features.n_mels={NUM_FEATURES}"])
    model, _, _ = setup(cfg, device)
    graphed = CudaGraphed(model, PAD_FRAMES, amp=True)
    batch = random_batch(torch.Generator().manual_seed(4), 4, 120)
    log_probs, _ = graphed(batch.features.to(device), batch.feature_lengths.to(device))
    assert graphed.is_captured((4, 150)) and torch.isfinite(log_probs).all()


@pytest.mark.cuda
def test_a_collection_due_during_a_capture_waits_for_its_end():
    """A graphed model left behind (by an earlier test, or an earlier row of benchmarks.train_step) sits in the
    reference cycle make_graphed_callables makes, which only the cyclic collector frees. A collection during the next
    capture destroyed its graphs, which capture forbids, and that capture failed (cudaErrorStreamCaptureInvalidated,
    once in this file's GPU run, torch warning "operation not permitted when stream is capturing")."""
    device = torch.device("cuda")
    cfg = compose_config(["model.depth=1", "model.hidden=32", "model.conv_channels=2", "model.backend=persistent",
                          "data.features.kind=mel", f"data.features.n_mels={NUM_FEATURES}", "train.amp=none"])
    env = DistEnv(0, 1, device)
    batch = random_batch(torch.Generator().manual_seed(0), 2, 60)
    model, optimizer, schedule = setup(cfg, device)
    left_behind = [CudaGraphed(model, PAD_FRAMES, amp=False)]
    assert train_step(left_behind[0], batch, optimizer, schedule, cfg, env)[0] == "ok"  # captures its graphs
    model, optimizer, schedule = setup(cfg, device)
    collector_enabled_in_capture = []

    def drop_and_collect(module, inputs):
        if torch.cuda.is_current_stream_capturing():
            left_behind.clear()  # the last reference outside the graphs' cycle
            collector_enabled_in_capture.append(gc.isenabled())
            if gc.isenabled():  # as the collector does on its own, at any allocation
                gc.collect()

    model.register_forward_pre_hook(drop_and_collect)
    outcome, loss, *_ = train_step(CudaGraphed(model, PAD_FRAMES, amp=False), batch, optimizer, schedule, cfg, env)
    assert collector_enabled_in_capture == [False]
    assert outcome == "ok" and math.isfinite(loss)


def test_the_collector_is_paused_inside_the_block_and_as_the_caller_left_it_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("a capture that failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # the caller's own pause outlasts the block
    finally:
        gc.enable()


def test_graphs_refuse_a_cudnn_layer_with_the_reason():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # refused before any capture
    cfg = compose_config(["model.depth=1", "model.hidden=32", "model.conv_channels=2", "model.backend=cudnn",
                          "data.features.kind=mel", f"data.features.n_mels={NUM_FEATURES}", "train.amp=none"])
    model, optimizer, schedule = setup(cfg, device)
    batch = random_batch(torch.Generator().manual_seed(0), 2, 60)
    with pytest.raises(ValueError, match="runs on cuDNN"):
        train_step(CudaGraphed(model, PAD_FRAMES, False), batch, optimizer, schedule, cfg, DistEnv(0, 1, device))


def test_the_refusal_of_a_cudnn_layer_names_the_batch_it_runs_at_its_slices():
    """batch_slice runs the layer (and asks its backend) at the slice's size: the refusal named the whole batch."""
    layer = torch.nn.Sequential(GRU(4, 8, batch_slice=4))  # on the CPU, "auto" runs cuDNN's path
    with pytest.raises(ValueError, match=r"runs on cuDNN at batch 4 \(a batch of 32 runs as slices of at most 4\)"):
        check_capturable(layer, 32, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"runs on cuDNN at batch 3 \(torch.float32\)"):
        check_capturable(layer, 3, torch.float32, torch.device("cpu"))


def test_pad_frames_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="pad_frames must be a positive integer, not 0"):
        CudaGraphed(torch.nn.Linear(2, 2), 0, amp=False)


def test_a_batch_replays_the_graphs_of_its_size_and_frames_padded_up_to_the_longest_shards():
    graphed = CudaGraphed(torch.nn.Linear(2, 2), PAD_FRAMES, amp=False)
    assert graphed.graph_shape(4, 95) == (4, 100)
    assert graphed.graph_shape(4, 100) == (4, 100)
    assert graphed.graph_shape(3, 101) == (3, 150)
    assert graphed.graph_shape(4, 95, min_frames=140) == (4, 150)  # another rank's shard is longer
    assert graphed.graph_shape(4, 95, min_frames=20) == (4, 100)
    assert not graphed.is_captured((4, 100))
