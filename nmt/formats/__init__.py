"""Checkpoints in other tools' formats: `nmt export` and `nmt import`.

ctranslate2   a checkpoint as a CTranslate2 model folder (`--format ctranslate2`, `--engine ctranslate2`)
huggingface   MarianMT (OPUS-MT) and Pegasus (pre-norm) folders to and from checkpoints
              (`--format huggingface`, `nmt import`)
export        `nmt export`: the checkpoint in the format asked for
model_card    the README.md of an exported folder
validate      foreign files checked before anything is built: config.json's fields and bounds, weights

Both read and write checkpoints through nmt.checkpoint and nothing above it; the CTranslate2 engine
(nmt.translate.ctranslate2_engine) reads the folders written here.
"""

FORMATS = ("ctranslate2", "huggingface")  # `nmt export --format`
# Every folder an export writes holds this file: it describes the folder, and `--force` replaces only a
# folder that has it (nmt.atomic.check_replaceable), never an unrelated one.
META_FILE = "nmt.json"
