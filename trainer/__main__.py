"""`python -m trainer [overrides]`: the Hydra entry point (configs in conf/; see conf/train.yaml).

A user error (missing corpus or manifest, a bad config value) prints one line and exits 2. Any other exception on
any rank prints that rank's traceback and ends the whole MPI job, so no rank is left waiting on a collective.
"""
import logging
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm.contrib.logging import logging_redirect_tqdm

from trainer import distributed
from trainer.train import train

log = logging.getLogger("trainer")


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        with logging_redirect_tqdm():  # log lines above the progress bar, not glued to its end
            result = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except (FileNotFoundError, ValueError) as error:
        log.error("error on rank %d: %s", distributed.launcher_rank(), error)
        distributed.abort_job(2)
    except Exception:
        log.error("training failed on rank %d:\n%s", distributed.launcher_rank(), traceback.format_exc())
        distributed.abort_job(1)
    else:
        if result and distributed.launcher_rank() == 0:  # every rank holds the same figures; one line says them
            print(f"final test WER {result['wer']:.2f}%  CER {result['cer']:.2f}%  (epoch {result['epoch']})")


if __name__ == "__main__":
    sys.exit(main())
