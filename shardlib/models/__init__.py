"""Models: layers that speak logical dims, the GPT, and size presets."""

from shardlib.models.gpt import GPT, Block, count_params
from shardlib.models.lm import gpt_model  # registers the GPT family with shardlib.contract
from shardlib.models.preference import preference_model  # registers DPO / SimPO's GPT
from shardlib.models.presets import PRESETS, check_model, get_preset

__all__ = ["GPT", "Block", "PRESETS", "check_model", "count_params", "get_preset",
           "gpt_model", "preference_model"]
