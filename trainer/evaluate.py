"""WER and CER over a corpus; `python -m trainer.evaluate` decodes a manifest with a saved checkpoint and prints them.

    python -m trainer.evaluate --checkpoint runs/NAME/checkpoints/best.pt [--manifest M.jsonl] [--out errors.tsv]
        [--skipped skipped.jsonl] [--beam 16] [--lm words.arpa --lm-weight 0.5 --word-bonus 1.0]
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from tqdm import tqdm

from data.cli import PROGRESS_LINE_S, input_path, shows_a_progress_bar
from data.dataset import TOO_LONG_FOR_STRIDE, UNREADABLE, SpeechDataset, collate, count_reasons
from data.manifest import check_manifest_path, print_paths_printable
from data.sampler import eval_shards
from data.text import counted, normalize_text
from trainer import build, decode
from trainer.cli import (cannot_write, check_not_an_input, lines_stream, log_above_progress_bars, output_file,
                         positive_int, run_tool, write_output)
from trainer.inference import MODEL_ERRORS, add_model_arguments, load_model
from trainer.metrics import ErrorCounts
from trainer.stop import ignore_in_data_workers, start_data_workers

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(model, dataset: SpeechDataset, batches: list[list[int]], device: torch.device, amp: str = "none",
             num_workers: int = 0, worker_timeout_s: float | None = None, progress_bar: bool = False,
             progress_line_s: float | None = None, decoder=decode.greedy_decode,
             stop=lambda: False, stopping=None) -> tuple[ErrorCounts, list[dict]]:
    """Decodes the given batches of `dataset` with `decoder` ((log_probs, lengths) -> texts); returns the error
    counts and one row per utterance. The model is left in the mode it came in. Without the bar, `progress_line_s`
    logs a line on the progress this often (a batch job's log, where a large test set ran for minutes unseen). Where
    `stop()` turns true (a training run's stop signal), it returns after the batch in progress, with what it has. A
    batch its workers do not give within `worker_timeout_s`, where given, raises trainer.stop.DataWorkersTimedOut; a
    worker that dies, trainer.stop.DataWorkerDied. Where `stopping()` (this process's stop signal, given) turns true
    while a batch is awaited, the wait ends there (trainer.stop.start_data_workers): a worker stuck meanwhile held the
    evaluation, and every rank waiting in `stop()` on this one, for `worker_timeout_s`."""
    was_training = model.training
    model.eval()
    counts = ErrorCounts()
    rows = []
    # Its workers leave stop signals to the process, which ends the evaluation early on them (`stop`).
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=num_workers,
                        worker_init_fn=ignore_in_data_workers)
    line_every_s = None if progress_bar else progress_line_s
    last_line = time.perf_counter()
    batches_read = start_data_workers(loader, worker_timeout_s, stopping)
    for number, batch in enumerate(tqdm(batches_read, desc="evaluating", total=len(loader), disable=not progress_bar,
                                        dynamic_ncols=True, leave=False), start=1):
        # None: the wait for this batch ended on a stop signal, which `stop()` still tells the other ranks of.
        if stop() or batch is None:
            break
        if line_every_s is not None and time.perf_counter() - last_line >= line_every_s:
            last_line = time.perf_counter()
            log.info("evaluating: batch %d of %d", number, len(loader))
        dataset.warn_once(batch.unusable)
        too_short = batch.num_unusable_as(TOO_LONG_FOR_STRIDE)
        counts.too_long_for_stride += too_short
        counts.unreadable += batch.num_unusable - too_short  # the rest: a test set has no max_duration
        if len(batch.indices) == 0:
            continue
        with build.autocast(amp, device):
            log_probs, out_lengths = model(batch.features.to(device), batch.feature_lengths.to(device))
        for index, hypothesis in zip(batch.indices.tolist(), decoder(log_probs, out_lengths)):
            utterance = dataset.utterances[index]
            reference = normalize_text(utterance.text)  # as the model was trained to spell it: upper case
            word_errors, char_errors = counts.add(reference, hypothesis)
            rows.append({
                "audio_filepath": utterance.audio_filepath, "reference": reference, "hypothesis": hypothesis,
                "word_errors": word_errors, "char_errors": char_errors,
            })
    model.train(was_training)
    return counts, rows


def left_out(dataset: SpeechDataset, counts: ErrorCounts) -> Counter:
    """The utterances of `dataset`'s manifests that an evaluation's WER leaves out, by reason (count_reasons words it):
    those the dataset left out at the start, and those `counts` found it could not decode. A transcript too long for
    its frames counts as one reason, whether the manifest's duration showed it or the audio did."""
    return dataset.skipped + Counter({UNREADABLE: counts.unreadable, TOO_LONG_FOR_STRIDE: counts.too_long_for_stride})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--manifest", type=input_path,
                        help="JSONL manifest to decode (default: the run's data.eval_manifest)")
    parser.add_argument("--out", type=output_file,
                        help="write a tab-separated table, a header, then one line per utterance: file, word "
                             "errors, character errors, reference, hypothesis")
    parser.add_argument("--skipped", type=output_file,
                        help="list every utterance of the manifest left out before decoding (its transcript empty, "
                             "unspellable or too long), one JSON object a line: file, reason, why; the log names the "
                             "first 5 of each reason")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="utterances a batch (default: 16)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        # Before the checkpoint and the language model are read: a large model takes minutes.
        inputs = [args.checkpoint, *(path for path in (args.lm, args.manifest) if path)]
        for output in (args.out, args.skipped):
            check_not_an_input(output, inputs)
        if args.out and args.skipped and Path(args.out).resolve() == Path(args.skipped).resolve():
            # The table was written over the list, which the log had said held every utterance left out.
            raise ValueError(f"--out and --skipped both name {args.out}: give each a file of its own")
        if args.manifest:
            check_manifest_path(Path(args.manifest))
        model, features, cfg, device = load_model(args)
        manifest = args.manifest or OmegaConf.select(cfg, "data.eval_manifest")
        if not args.manifest:  # the run's, which only its checkpoint names
            if not isinstance(manifest, str):  # a checkpoint edited by hand: a number or a list ended in a traceback
                raise ValueError(f"{args.checkpoint}: its data.eval_manifest is {manifest!r}, not a path: give "
                                 "--manifest")
            if not Path(manifest).is_absolute() and not Path(manifest).exists():
                raise FileNotFoundError(f"the run's data.eval_manifest {manifest} is relative to the folder its "
                                        "training ran in: run this there, or give --manifest")
            # A pipe given as --manifest is read; one a checkpoint names would be waited on for a writer, for ever.
            if Path(manifest).exists() and not Path(manifest).is_file():
                raise ValueError(f"the run's data.eval_manifest {manifest} is not a file (a pipe, a device, a folder): "
                                 "give --manifest")
            for output in (args.out, args.skipped):
                check_not_an_input(output, [manifest])
        dataset = SpeechDataset([manifest], features, None, model.time_stride, skip_list=args.skipped)
        decoder = decode.from_arguments(args)
    except MODEL_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # Outside the catch above: a reader that stopped early (--skipped /dev/stdout | head) is run_tool's to end quietly,
    # and a list that cannot be written is named in one line, as --out's table is.
    with cannot_write(args.skipped):
        dataset.write_skip_list()
    (batches,) = eval_shards(dataset.durations, 1, args.batch_size)
    try:
        with log_above_progress_bars():
            counts, rows = evaluate(model, dataset, batches, device, progress_bar=shows_a_progress_bar(sys.stderr),
                                    progress_line_s=PROGRESS_LINE_S, decoder=decoder)
    except ValueError as error:  # the model's output not finite (decode.check_finite)
        print(f"error: {args.checkpoint}: {error}", file=sys.stderr)
        return 2
    if not rows:  # before --out is written: an earlier table there stays
        print(f"error: none of the {counted(len(dataset), 'utterance')} of {manifest} could be decoded (warned about "
              "above)", file=sys.stderr)
        return 1
    if args.out:
        # Written as they are, not as messages quote them (data.manifest.printable): the table names each file to find
        # it by, read_manifest refuses a path that would break or reorder a row, and the texts hold only the alphabet
        # (the dataset leaves out a transcript with any other character; a hypothesis is decoded from it).
        lines = ["audio_filepath\tword_errors\tchar_errors\treference\thypothesis\n"]
        lines += ["{audio_filepath}\t{word_errors}\t{char_errors}\t{reference}\t{hypothesis}\n".format(**row)
                  for row in sorted(rows, key=lambda row: row["audio_filepath"])]
        write_output(args.out, "".join(lines))
    # The WER is over the utterances decoded: say which others the manifest held (each named in a warning above).
    reasons = count_reasons(left_out(dataset, counts))
    reasons = f"; left out: {reasons}" if reasons else ""
    print(f"WER {counts.wer:.2f}%  CER {counts.cer:.2f}%  "
          f"({counted(len(rows), 'utterance')}, {counted(counts.words, 'word')}{reasons})",
          file=lines_stream(args.out, args.skipped))
    return 0


if __name__ == "__main__":
    print_paths_printable(sys.stdout, sys.stderr)
    sys.exit(run_tool(main))
