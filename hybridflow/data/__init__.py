"""Prompt data: verl-schema datasets, the resumable sampler, built-in tasks and converters.

The built-in task lives in ``hybridflow.data.tasks.arithmetic`` and the GSM8K converter in
``hybridflow.data.gsm8k``; they are not imported here because they pull in pyarrow.
"""

from hybridflow.data.dataset import DatasetStats, PromptRow, RLDataset
from hybridflow.data.row_files import BadRowReason, DataError, load_rows
from hybridflow.data.sampler import ResumableSampler

__all__ = [
    "BadRowReason",
    "DataError",
    "DatasetStats",
    "PromptRow",
    "RLDataset",
    "ResumableSampler",
    "load_rows",
]
