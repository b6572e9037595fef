"""HF <-> megatron-core conversion: one declarative name map per model family (docs/architecture.md, convention 11).

* :mod:`.transforms` - typed tensor transforms (fused QKV per query group, gated MLP, TP splits)
* :mod:`.base` - model dims and the parallel sizes they allow; the families (config facts, weight rules,
  the registry) are :mod:`megatron_credit.families`, one file each
* :mod:`.streaming` - full-tensor HF <-> megatron generators; :mod:`.live` - a TP/PP-sharded model
  (loading, and the bucketed HF-named weight generator used by weight sync)
* :mod:`.hf_io` - streaming safetensors reader/writer; :mod:`.testing` - tiny configs, random checkpoints
* :mod:`.converters` - HF folder <-> dist-checkpoint converters (used by ``tools/convert_*``);
  :mod:`.model_io` - a converted folder's files and the model it loads into; :mod:`.mcore_save` -
  workarounds on megatron-core's private torch_dist save machinery (all three use megatron-core)

Importing this package needs torch only (megatron-core and transformers are imported where used).
"""
from megatron_credit.conversion.base import ModelDims
from megatron_credit.families import FAMILIES, Family, family_for_config, supported_architectures
from megatron_credit.conversion.live import iter_hf_weight_buckets, load_hf_into_local_state
from megatron_credit.conversion.streaming import check_hf_keys, iter_hf_from_megatron, iter_megatron_from_hf

__all__ = ["FAMILIES", "Family", "ModelDims", "family_for_config", "supported_architectures",
           "iter_hf_weight_buckets", "load_hf_into_local_state", "check_hf_keys", "iter_hf_from_megatron",
           "iter_megatron_from_hf"]
