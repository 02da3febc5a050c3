"""The contracts every part shares (torch and `topp_rl.ops` only): a sample with its kept sets, the sampling
settings, a prompt record, and the packed batches the trainer trains on."""

from topp_rl.data.batch import PackedBatch, RolloutBatch
from topp_rl.data.params import SamplingParams
from topp_rl.data.prompt import Messages, PromptRecord, prompt_text
from topp_rl.data.sample import Sample, SampleStatus, number_samples

__all__ = ["Messages", "PackedBatch", "PromptRecord", "RolloutBatch", "Sample", "SampleStatus", "SamplingParams",
           "number_samples", "prompt_text"]
