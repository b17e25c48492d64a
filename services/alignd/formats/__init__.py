"""On-disk formats: what the daemon writes and reads on a filesystem, and nothing else.

No Redis, no web, no metrics: this layer imports only the numerical core (``libalign``) and
the wire contract (``alignclient``: errors, the id rule). Directories appear whole or not at
all (and disappear the same way) through the core's :mod:`libalign.atomic_dir`, which the model
cache shares.

* :mod:`.hf_checkpoint` – Hugging Face safetensors checkpoints: the one index reader, the
  shard writers, the file names (index, config, ``manifest.json``);
* :mod:`.selection` – the one expert-selection policy: which tensors get quantized;
* :mod:`.published` – the learner's BF16 versions (an HF checkpoint under ``published/``);
* :mod:`.weight_store` / :mod:`.sharded_version` – NVFP4 versions for samplers, written whole
  or by expert-parallel parts, checksummed;
* :mod:`.manifest` – a store version's ``manifest.json`` as one typed, frozen ``Manifest``
  (the file format, read with field-naming errors and written back unchanged);
* :mod:`.convert` – a published version into the weight store (the converter's data path);
* :mod:`.modelopt_export` – a store version re-laid out as the ModelOpt NVFP4 checkpoint SGLang
  loads (written once per version, never quantized again);
* :mod:`.export_plan`, :mod:`.quant_configs`, :mod:`.export` – ``alignd convert``: an HF
  checkpoint into a ModelOpt or compressed-tensors NVFP4 checkpoint.
"""
