"""Old path of :mod:`megatron_credit.run_dir` (where a run keeps its checkpoints), kept for one release:
launch scripts copied from ``examples/launch/`` import it. Importing it warns."""
import warnings

from megatron_credit.run_dir import (_DIR, CRITIC_OPTIM, MODEL_OPTIM, checkpoint_dir,  # noqa: F401
                                     complete_checkpoints)

warnings.warn("megatron_credit.run_layout is now megatron_credit.run_dir; the old module goes in the next release",
              DeprecationWarning, stacklevel=2)
