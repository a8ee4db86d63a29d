"""Job configs: loading YAML plus overrides into pydantic records (``base``), the train job (``train``), the SFT
job and warm start (``sft``), tasks and data (``task``), prompts (``prompts``), monitoring (``monitor``) and
comparisons (``compare``)."""
