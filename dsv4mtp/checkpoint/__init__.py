"""Checkpoint machinery shared by both implementations: the MTP parameter schema, name
remapping, safetensors I/O, loading, the NVFP4 fold, synthetic checkpoints and inspection."""
