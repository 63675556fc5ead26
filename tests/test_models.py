"""DeepSpeech2: shapes, output lengths, padding masked everywhere, deep residual stacks, backends, synced batch norm."""
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from models import DeepSpeech2, MaskedBatchNorm
from models.deepspeech2 import Lookahead, RecurrentLayer
from prnn_kernels import relative_error

NUM_FEATURES = 13
NUM_CLASSES = 6
LENGTHS = [23, 14, 5]
# (cell, bidirectional, batch_norm): every cell both ways with batch norm, and one without it.
ARCHITECTURES = [(cell, bidir, True) for cell in ("relu", "tanh", "gru", "lstm") for bidir in (True, False)]
ARCHITECTURES.append(("gru", False, False))


def small_model(cell, bidirectional, batch_norm=True, **kwargs):
    torch.manual_seed(0)
    kwargs = dict(depth=2, hidden=10, lookahead=3, conv_channels=4) | kwargs
    kwargs |= dict(cell=cell, bidirectional=bidirectional, batch_norm=batch_norm)
    return DeepSpeech2(NUM_FEATURES, NUM_CLASSES, **kwargs)


def ragged_batch(dtype=torch.float32):
    """features (B, T, F) with random values in the padding too, and lengths (B,)."""
    lengths = torch.tensor(LENGTHS)
    return torch.randn(len(LENGTHS), max(LENGTHS), NUM_FEATURES, dtype=dtype), lengths


@pytest.mark.parametrize("cell, bidirectional, batch_norm", ARCHITECTURES)
def test_output_shapes_and_lengths(cell, bidirectional, batch_norm):
    model = small_model(cell, bidirectional, batch_norm)
    features, lengths = ragged_batch()
    log_probs, out_lengths = model(features, lengths)
    num_frames = model.output_lengths(torch.tensor(max(LENGTHS))).item()
    assert log_probs.shape == (num_frames, len(LENGTHS), NUM_CLASSES)
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.logsumexp(dim=2), torch.zeros(num_frames, len(LENGTHS)))
    assert torch.equal(out_lengths, model.output_lengths(lengths))
    assert torch.equal(out_lengths, (lengths + model.time_stride - 1) // model.time_stride)


def test_log_probs_are_float32_under_bf16_autocast_and_float64_for_a_float64_model():
    """CTC wants float32 log-probs: CPU autocast leaves the classifier's bf16 logits, and their log-softmax, in bf16,
    so the model casts them itself; a float64 model keeps float64."""
    model = small_model("gru", True, backend="reference")
    features, lengths = ragged_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs, _ = model(features, lengths)
    assert log_probs.dtype == torch.float32
    log_probs, _ = model.double()(features.double(), lengths)
    assert log_probs.dtype == torch.float64


def test_lengths_the_features_cannot_hold_are_refused_naming_them():
    model = small_model("gru", False)
    features = torch.randn(2, 11, NUM_FEATURES)
    for lengths in ([11, 12], [11, 0], [11, -3]):  # [11, 12] gives the same output frames as [11, 11] (stride 2)
        with pytest.raises(ValueError, match=rf"DeepSpeech2: lengths must lie in \[1, T=11\], got \{lengths}"):
            model(features, torch.tensor(lengths))
    with pytest.raises(ValueError, match=r"DeepSpeech2: lengths must have shape \(2,\), one per sample, got \(3,\)"):
        model(features, torch.tensor([11, 11, 11]))


@pytest.mark.parametrize("shape", [(2, 11, 14), (2, 11, 15), (2, 11, 12), (11, NUM_FEATURES)])
def test_features_of_another_width_are_refused_naming_it(shape):
    model = small_model("gru", False)  # the front end's stride maps 14 and 15 features to the width 13 gives
    message = f"DeepSpeech2: features must have shape (B, T, num_features={NUM_FEATURES}), got {shape}"
    with pytest.raises(ValueError, match=re.escape(message)):
        model(torch.randn(shape), torch.tensor([11, 11]))


@pytest.mark.parametrize("cell, bidirectional, batch_norm", ARCHITECTURES)
def test_each_sample_decodes_as_if_alone(cell, bidirectional, batch_norm):
    model = small_model(cell, bidirectional, batch_norm).double()
    features, lengths = ragged_batch(torch.float64)
    model(features, lengths)  # one training step's batch statistics, so eval's running statistics are not trivial
    model.eval()
    with torch.no_grad():
        log_probs, out_lengths = model(features, lengths)
        for b, length in enumerate(lengths):
            alone, alone_length = model(features[b : b + 1, :length], length[None])
            assert alone.shape[0] == alone_length.item() == out_lengths[b].item()
            assert relative_error(log_probs[: alone.shape[0], b], alone[:, 0]) < 1e-10


@pytest.mark.parametrize("cell, bidirectional, batch_norm", ARCHITECTURES)
def test_padding_values_change_nothing_in_training(cell, bidirectional, batch_norm):
    model = small_model(cell, bidirectional, batch_norm).double()
    features, lengths = ragged_batch(torch.float64)
    padded = torch.arange(features.shape[1])[None, :] >= lengths[:, None]  # (B, T)
    other_padding = torch.where(padded[:, :, None], 1e3 * torch.randn_like(features), features)
    results = []
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    for values in (features, other_padding):
        model.load_state_dict(buffers, strict=False)  # the same running means: the batch norms' sums are taken off them
        values = values.clone().requires_grad_()
        log_probs, _ = model(values, lengths)
        upstream = torch.linspace(-1, 1, log_probs.numel(), dtype=log_probs.dtype).view_as(log_probs)
        grads = torch.autograd.grad((log_probs * upstream).sum(), [values, *model.parameters()])
        results.append([log_probs, *grads])
    for first, second in zip(*results, strict=True):
        torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert not results[0][1][padded].any()


def test_more_padding_changes_nothing_in_training():
    # The batch norms' statistics count valid frames only, so the same utterances padded to a longer batch train alike.
    model = small_model("gru", True).double()
    features, lengths = ragged_batch(torch.float64)
    longer = torch.cat([features, torch.zeros(len(LENGTHS), 17, NUM_FEATURES, dtype=torch.float64)], dim=1)
    log_probs, out_lengths = model(features, lengths)
    longer_log_probs, _ = model(longer, lengths)
    for b, length in enumerate(out_lengths.tolist()):
        assert relative_error(longer_log_probs[:length, b], log_probs[:length, b]) < 1e-10


def test_the_front_end_clips_its_activations_to_0_20():
    model = small_model("gru", True, batch_norm=False)
    with torch.no_grad():
        for conv in model.front_end.convs:
            conv.weight.mul_(100)
    features = 10 * torch.randn(2, 30, NUM_FEATURES, generator=torch.Generator().manual_seed(0))
    x = model.front_end(features, torch.tensor([30, 20]))
    assert x.max() == 20 and x.min() == 0


def test_a_bidirectional_layer_sums_the_directions_torch_computes():
    layer = RecurrentLayer("gru", 5, 7, bidirectional=True, backend="reference", batch_norm=False).double()
    torch_gru = torch.nn.GRU(5, 7, bidirectional=True, dtype=torch.float64)
    torch_gru.load_state_dict(layer.rnn.state_dict())
    x = torch.randn(6, 3, 5, dtype=torch.float64)
    lengths = torch.tensor([6, 4, 2])
    mask = (torch.arange(6)[:, None] < lengths[None, :])[:, :, None]
    packed_output, _ = torch_gru(pack_padded_sequence(x, lengths, enforce_sorted=False))
    both, _ = pad_packed_sequence(packed_output, total_length=6)
    assert relative_error(layer(x, lengths, mask), both[..., :7] + both[..., 7:]) < 1e-10


def test_hundred_layer_residual_stack_trains():
    model = small_model("gru", True, depth=100, hidden=4, residual=True, conv_channels=2)
    features, lengths = ragged_batch()
    inputs, outputs = [], []
    for layer in model.layers:
        layer.register_forward_hook(lambda module, args, output: inputs.append(args[0]) or outputs.append(output))
    model.classifier.register_forward_hook(lambda module, args, output: inputs.append(args[0]))
    log_probs, out_lengths = model(features, lengths)
    # Each layer after the first adds its output to its input: the next layer's input, or the last one's classifier's
    # (a bidirectional stack has no lookahead), is the sum.
    assert torch.equal(inputs[1], outputs[0])
    for index in range(1, 100):
        assert torch.equal(inputs[index + 1], inputs[index] + outputs[index]), f"layer {index}"
    targets, target_lengths = torch.tensor([[1, 2], [3, 3], [4, 5]]), torch.tensor([2, 2, 1])
    loss = torch.nn.functional.ctc_loss(log_probs, targets, out_lengths, target_lengths)
    loss.backward()
    assert torch.isfinite(loss)
    for name, parameter in model.named_parameters():
        assert torch.isfinite(parameter.grad).all(), name
    assert model.front_end.convs[0].weight.grad.abs().sum() > 0


# torch.nn's recurrent op of each cell, on a CPU and ahead of cuDNN's on a GPU.
ATEN_RECURRENT_OPS = {"relu": "aten::rnn_relu", "tanh": "aten::rnn_tanh", "gru": "aten::gru", "lstm": "aten::lstm"}


def log_probs_and_recurrent_ops(model, features, lengths):
    """The model's log-probs, and which of ATen's recurrent ops computing them ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        log_probs = model(features, lengths)[0]
    return log_probs, {event.name for event in profiled.events()} & set(ATEN_RECURRENT_OPS.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])  # ATen's RNN, then cuDNN
@pytest.mark.parametrize("cell, bidirectional", [("relu", True), ("tanh", False), ("gru", True), ("lstm", False)])
def test_reference_and_cudnn_backends_agree(cell, bidirectional, device):
    features, lengths = ragged_batch(torch.float64)
    features, lengths = features.to(device), lengths.to(device)
    reference = small_model(cell, bidirectional, backend="reference").double().to(device)
    cudnn = small_model(cell, bidirectional, backend="cudnn").double().to(device)
    cudnn.load_state_dict(reference.state_dict())
    for train in (False, True):
        reference.train(train)
        cudnn.train(train)
        expected, on_cudnn = log_probs_and_recurrent_ops(cudnn, features, lengths)
        actual, on_reference = log_probs_and_recurrent_ops(reference, features, lengths)
        # Each on its own backend: a cudnn backend that ran the reference recurrence passed, compared with itself.
        assert (on_cudnn, on_reference) == ({ATEN_RECURRENT_OPS[cell]}, set()), f"train={train}"
        assert relative_error(actual, expected) < 1e-10, f"train={train}"
    upstream = torch.randn_like(expected)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), list(cudnn.parameters()))
    actual_grads = torch.autograd.grad((actual * upstream).sum(), list(reference.parameters()))
    for (name, _), a, e in zip(reference.named_parameters(), actual_grads, expected_grads, strict=True):
        assert relative_error(a, e) < 1e-10, name


@pytest.mark.parametrize("backend", ["reference", "cudnn"])
def test_batch_slices_train_the_same_function(backend, monkeypatch):
    """Recurrent layers on slices of 2 utterances (a per-GPU batch of 2 on one device): batch norm still sees the whole
    batch, so the training forward and every gradient are the whole batch's."""
    features, lengths = ragged_batch(torch.float64)
    whole = small_model("gru", True, backend=backend).double()
    sliced = small_model("gru", True, backend=backend, batch_slice=2).double()
    run_sizes = []
    for layer in sliced.layers:
        run = layer.rnn._forward_on
        monkeypatch.setattr(layer.rnn, "_forward_on", lambda backend, input, hx, lengths, run=run: run_sizes.append(
            input.shape[1]) or run(backend, input, hx, lengths))
    results = []
    for model in (whole, sliced):
        log_probs, _ = model(features, lengths)
        upstream = torch.linspace(-1, 1, log_probs.numel(), dtype=log_probs.dtype).view_as(log_probs)
        results.append([log_probs, *torch.autograd.grad((log_probs * upstream).sum(), list(model.parameters()))])
    assert run_sizes == [2, 1] * len(sliced.layers)  # 3 utterances: a slice of 2, then 1, in every layer
    for whole_value, sliced_value in zip(*results, strict=True):
        assert relative_error(sliced_value, whole_value) < 1e-10


def test_lookahead_mixes_the_current_and_next_frames():
    lookahead = Lookahead(channels=1, lookahead=2)
    with torch.no_grad():
        lookahead.conv.weight.copy_(torch.tensor([[[1.0, 10.0, 100.0]]]))  # weights for frames t, t+1, t+2
    impulse = torch.zeros(6, 1, 1)  # (T, B, H)
    impulse[3] = 1
    assert lookahead(impulse).flatten().tolist() == [0.0, 100.0, 10.0, 1.0, 0.0, 0.0]


def test_the_lookahead_output_is_clipped_to_0_20():
    """DeepSpeech2's clipped ReLU after the lookahead convolution, before the classifier, as after the front end."""
    model = small_model("gru", False)
    with torch.no_grad():
        model.lookahead.conv.weight.mul_(1000)
    classifier_inputs = []
    model.classifier.register_forward_hook(lambda module, args, output: classifier_inputs.append(args[0]))
    model(*ragged_batch())
    assert classifier_inputs[0].min() == 0 and classifier_inputs[0].max() == 20


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match="cell='elman'"):
        DeepSpeech2(NUM_FEATURES, NUM_CLASSES, cell="elman")
    with pytest.raises(ValueError, match="depth=0"):
        DeepSpeech2(NUM_FEATURES, NUM_CLASSES, depth=0)
    with pytest.raises(ValueError, match="backend='fast'"):
        DeepSpeech2(NUM_FEATURES, NUM_CLASSES, hidden=8, backend="fast")


@pytest.mark.parametrize("argument, value, must_be", [
    ("conv_channels", 0, "an integer of at least 1"),  # torch.nn named it input_size
    ("num_features", 0, "an integer of at least 1"),
    ("num_classes", 0, "an integer of at least 1"),  # built a model of empty outputs
    ("hidden", 8.0, "an integer of at least 1"),
    ("depth", True, "an integer of at least 1"),
    ("lookahead", 1.5, "an integer of at least 0"),  # a TypeError from inside torch.empty
    ("bidirectional", "no", "True or False"),  # a true string: it built both directions
    ("residual", "no", "True or False"),
    ("batch_norm", None, "True or False"),
])
def test_arguments_are_checked_by_their_own_names(argument, value, must_be):
    arguments = dict(num_features=NUM_FEATURES, num_classes=NUM_CLASSES, hidden=8, bidirectional=False)
    arguments[argument] = value
    with pytest.raises(ValueError, match=re.escape(f"DeepSpeech2: {argument}={value!r} must be {must_be}")):
        DeepSpeech2(**arguments)


@pytest.mark.parametrize("channel_dim", [1, 2])
def test_masked_batch_norm_is_batch_norm_over_valid_frames(channel_dim):
    torch.manual_seed(0)
    channels = 5
    lengths = torch.tensor([6, 1, 4])  # the values past them must not count, not even NaN
    valid = torch.arange(6)[None, :] < lengths[:, None]  # (B, T)
    if channel_dim == 2:  # sequence-wise: (T, B, H)
        x = 2 * torch.randn(6, 3, channels, dtype=torch.float64) + 1
        mask = valid.t().unsqueeze(2)
    else:  # conv front end: (B, C, F, T)
        x = 2 * torch.randn(3, channels, 4, 6, dtype=torch.float64) + 1
        mask = valid[:, None, None, :]
    x = x.masked_fill(~mask, float("nan"))
    upstream = torch.randn(x.shape, dtype=torch.float64)
    masked = MaskedBatchNorm(channels, channel_dim).double()
    plain = torch.nn.BatchNorm1d(channels, dtype=torch.float64)
    with torch.no_grad():  # weights other than the initial ones, so their gradients' paths count
        for norm in (masked, plain):
            norm.weight.copy_(torch.linspace(0.5, 2, channels))
            norm.bias.copy_(torch.linspace(-1, 1, channels))

    def channels_last(tensor):
        return tensor.permute(0, 2, 3, 1) if channel_dim == 1 else tensor

    valid_positions = channels_last(torch.broadcast_to(mask, x.shape))[..., 0]
    # Two training passes: the second's sums are taken about a running mean no longer zero, which its mean adds back.
    for train in (True, True, False):
        masked.train(train)
        plain.train(train)
        x_masked, x_plain = x.clone().requires_grad_(), channels_last(x)[valid_positions].requires_grad_()
        output = masked(x_masked, mask)
        expected = plain(x_plain)  # (N valid, C)
        assert relative_error(channels_last(output)[valid_positions], expected) < 1e-12, f"train={train}"
        assert not channels_last(output)[~valid_positions].any()
        actual_grads = torch.autograd.grad((output * upstream).sum(), [x_masked, masked.weight, masked.bias])
        expected_grads = torch.autograd.grad((expected * channels_last(upstream)[valid_positions]).sum(),
                                             [x_plain, plain.weight, plain.bias])
        assert relative_error(channels_last(actual_grads[0])[valid_positions], expected_grads[0]) < 1e-12
        assert not channels_last(actual_grads[0])[~valid_positions].any()
        for actual, wanted in zip(actual_grads[1:], expected_grads[1:]):
            assert relative_error(actual, wanted) < 1e-12, f"train={train}"
    assert relative_error(masked.running_var, plain.running_var) < 1e-12
    assert relative_error(masked.running_mean, plain.running_mean) < 1e-12


def test_batch_statistics_in_fp32_keep_their_digits_far_from_zero():
    """The variance is the mean square less the squared mean; taken of x less the running mean, a channel whose mean
    is 1000 standard deviations from zero keeps fp32's digits (taken of x itself, the variance came out 3x off)."""
    x = (1000 + torch.randn(400, 8, 16, dtype=torch.float64)).float()
    mask = torch.ones(400, 8, 1, dtype=torch.bool)
    norm = MaskedBatchNorm(16, channel_dim=2)
    with torch.no_grad():
        norm.running_mean.fill_(999.5)  # as a trained model's running mean stands near its batches' means
    exact = x.double()
    expected = (exact - exact.mean((0, 1))) / torch.sqrt(exact.var((0, 1), unbiased=False) + norm.eps)
    assert relative_error(norm(x, mask).double(), expected) < 1e-5


def test_evaluation_in_bf16_normalises_far_from_zero_as_training_does():
    """In evaluation a bf16 channel whose mean stands 100 standard deviations from zero is centred in float32, as
    training centres it: x * scale + shift taken in bf16 cancelled to 0.75 off."""
    x = (100 + torch.randn(50, 4, 16, dtype=torch.float64)).to(torch.bfloat16)
    mask = torch.ones(50, 4, 1, dtype=torch.bool)
    norm = MaskedBatchNorm(16, channel_dim=2)
    with torch.no_grad():
        norm.running_mean.copy_(x.double().mean((0, 1)))
        norm.running_var.copy_(x.double().var((0, 1)))
        norm.weight.uniform_(0.5, 2)
        norm.bias.uniform_(-1, 1)
    norm.eval()
    exact = x.double()
    expected = (exact - norm.running_mean.double()) * torch.rsqrt(norm.running_var.double() + norm.eps)
    expected = expected * norm.weight.double() + norm.bias.double()
    output = norm(x, mask)
    assert output.dtype == torch.bfloat16
    assert relative_error(output.double(), expected) < 2**-8  # the output's own rounding


def test_training_normalises_a_bf16_input_into_bf16_as_evaluation_does():
    """Its statistics are taken in float32; what it returns is the next layer's input, in the input's dtype."""
    x = torch.randn(5, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    output = MaskedBatchNorm(4, channel_dim=2)(x, torch.ones(5, 2, 1, dtype=torch.bool))
    assert output.dtype == torch.bfloat16
    output.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_one_valid_value_leaves_the_running_variance_as_it_was():
    norm = MaskedBatchNorm(3, channel_dim=2)
    x = torch.randn(2, 1, 3)
    norm(x, torch.tensor([True, False]).view(2, 1, 1))  # one valid frame: no unbiased variance
    assert torch.equal(norm.running_var, torch.ones(3))
    assert torch.allclose(norm.running_mean, 0.1 * x[0, 0])


def test_a_constant_channel_normalises_to_its_bias_though_its_variance_rounds_below_zero():
    """The variance is the mean square less the squared mean: of 100 frames of 13.1 about a running mean of 0 it rounds
    to -8e-5 in fp32, past eps, which made every output of the channel non-finite."""
    norm = MaskedBatchNorm(4, channel_dim=2)
    with torch.no_grad():
        norm.bias.copy_(torch.linspace(-1, 1, 4))
    output = norm(torch.full((100, 1, 4), 13.1), torch.ones(100, 1, 1, dtype=torch.bool))
    assert torch.allclose(output, norm.bias.detach().expand_as(output), atol=1e-2)


def test_an_empty_training_batch_leaves_the_running_statistics_as_they_were():
    model = small_model("gru", False)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    log_probs, out_lengths = model(torch.randn(0, 7, NUM_FEATURES), torch.zeros(0, dtype=torch.int64))
    assert log_probs.shape == (4, 0, NUM_CLASSES) and out_lengths.shape == (0,)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name


# Synced batch norm: two gloo ranks, each with half the batch and a different number of valid frames, must
# normalise exactly as one process does with the whole batch.
SYNC_WORLD_SIZE = 2
SYNC_LENGTHS = [6, 1, 4, 5]  # rank 0 holds 7 valid frames, rank 1 holds 9


def sync_batch():
    """x (T, B, H) with a non-zero mean, mask (T, B, 1), upstream gradient (T, B, H); the same in every process."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor(SYNC_LENGTHS)
    x = 3 * torch.randn(max(SYNC_LENGTHS), len(SYNC_LENGTHS), 5, generator=generator, dtype=torch.float64) + 1
    mask = (torch.arange(x.shape[0])[:, None] < lengths[None, :]).unsqueeze(2)
    return x, mask, torch.randn(x.shape, generator=generator, dtype=torch.float64)


def normalise(x, mask, upstream, sync_stats):
    norm = MaskedBatchNorm(x.shape[2], channel_dim=2).double()
    norm.sync_stats = sync_stats
    x = x.clone().requires_grad_()
    output = norm(x, mask)
    (output * upstream).sum().backward()
    return {
        "output": output.detach(),
        "input_grad": x.grad,
        "weight_grad": norm.weight.grad,
        "bias_grad": norm.bias.grad,
        "running_mean": norm.running_mean,
        "running_var": norm.running_var,
    }


def rank_shard(rank):
    """This rank's half of sync_batch()."""
    shard = slice(rank * 2, rank * 2 + 2)
    return [tensor[:, shard] for tensor in sync_batch()]


def sync_worker(rank, directory):
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=SYNC_WORLD_SIZE)
    try:
        result = normalise(*rank_shard(rank), sync_stats=True)
        # The trainer's DDP sums parameter gradients across ranks; do the same here.
        for key in ("weight_grad", "bias_grad"):
            dist.all_reduce(result[key])
        torch.save(result, f"{directory}/rank{rank}.pt")
        # In the same process group, sync_stats off (train.sync_batch_norm=false): this rank's frames alone.
        torch.save(normalise(*rank_shard(rank), sync_stats=False), f"{directory}/rank{rank}_unsynced.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sync_ranks(tmp_path_factory):
    """Each gloo rank's results of sync_worker, synced and not: one spawn for the tests that read them."""
    directory = tmp_path_factory.mktemp("sync_stats")
    torch.multiprocessing.spawn(sync_worker, args=(str(directory),), nprocs=SYNC_WORLD_SIZE)
    return [{synced: torch.load(directory / f"rank{rank}{suffix}.pt", weights_only=True)
             for synced, suffix in ((True, ""), (False, "_unsynced"))} for rank in range(SYNC_WORLD_SIZE)]


def test_sync_stats_matches_whole_batch(sync_ranks):
    ranks = [results[True] for results in sync_ranks]
    expected = normalise(*sync_batch(), sync_stats=False)
    for key in ("output", "input_grad"):
        actual = torch.cat([result[key] for result in ranks], dim=1)
        assert relative_error(actual, expected[key]) < 1e-12, key
    for result in ranks:
        for key in ("weight_grad", "bias_grad", "running_mean", "running_var"):
            assert relative_error(result[key], expected[key]) < 1e-12, key


def test_sync_stats_off_normalises_each_rank_by_its_own_frames(sync_ranks):
    """With a process group up, as every multi-GPU run has, sync_stats off still takes no other rank's statistics."""
    for rank, results in enumerate(sync_ranks):
        expected = normalise(*rank_shard(rank), sync_stats=False)  # no process group in this process
        for key, value in expected.items():
            assert relative_error(results[False][key], value) < 1e-12, f"rank {rank}: {key}"


def test_sync_stats_without_a_process_group_normalises_this_process_alone():
    """sync_stats needs a process group up to take effect: a single process, which has none, normalises on its own."""
    alone = normalise(*sync_batch(), sync_stats=False)
    for key, value in normalise(*sync_batch(), sync_stats=True).items():
        assert torch.equal(value, alone[key]), key


def test_sync_batch_norm_switches_every_batch_norm_and_nothing_else():
    model = DeepSpeech2(num_features=40, num_classes=29, depth=3, hidden=8, conv_channels=2)
    norms = [module for module in model.modules() if isinstance(module, MaskedBatchNorm)]
    assert len(norms) == 4 and not any(norm.sync_stats for norm in norms)  # two conv layers, two recurrent inputs
    model.sync_batch_norm(True)
    assert all(norm.sync_stats for norm in norms)
    assert not [module for module in model.modules() if hasattr(module, "sync_stats") and module not in norms]
    model.sync_batch_norm(False)
    assert not any(norm.sync_stats for norm in norms)
