"""The files a job reads before it trains, each checked as there and open to this process before the job starts
(check_inputs): its manifests, or under data.an4_source AN4's folder, from which the run writes them. The checkpoint
train.resume=PATH names is trainer.resume.checkpoint_to_resume's to check, which every caller asks next. What they hold
is the run's to read: a large corpus's manifests are not read here.
"""
import contextlib
from pathlib import Path

from omegaconf import DictConfig

from data.manifest import check_manifest_path
from data.prepare import AN4_SPLITS, an4_manifest, an4_source_folder


@contextlib.contextmanager
def naming_the_an4_source():
    """A file or folder of AN4's source missing, named with the key that sets it: data/ knows no config keys."""
    try:
        yield
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{error} (data.an4_source, AN4's folder; PRNN_AN4 sets its default)") from None


def check_inputs(cfg: DictConfig) -> None:
    """FileNotFoundError or ValueError, in the run's own words, naming the first file the run would fail to read: a
    manifest that is missing, a folder, cannot be opened or is empty; AN4's folder where the run writes its manifests
    from it (they need not be there yet)."""
    written = set()
    if cfg.data.an4_source is not None:
        with naming_the_an4_source():
            an4_source_folder(cfg.data.an4_source)
        written = {an4_manifest(cfg.data.manifest_dir, split).absolute() for split in AN4_SPLITS}
    for manifest in [*cfg.data.train_manifests, cfg.data.eval_manifest]:
        if Path(manifest).absolute() not in written:  # another test set beside AN4 (data.eval_manifest=...) is read
            check_manifest_path(Path(manifest))
