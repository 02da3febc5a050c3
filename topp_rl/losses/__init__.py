"""RL losses: small classes `loss(inputs: LossInputs) -> (loss, metrics)`, selected by `conf/algo/*.yaml`."""

from topp_rl.losses.aggregate import AGGREGATIONS, aggregate
from topp_rl.losses.algorithms import CISPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss, ReinforcePPLoss
from topp_rl.losses.base import PolicyLoss
from topp_rl.losses.correction import TIS, IcePop
from topp_rl.losses.distill import OPDLoss
from topp_rl.losses.inputs import LossInputs
from topp_rl.losses.kl import KL_ESTIMATORS, KLPenalty, kl_estimate
from topp_rl.losses.teacher import TeacherKL

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "CISPOLoss",
    "DrGRPOLoss",
    "GRPOLoss",
    "GSPOLoss",
    "IcePop",
    "KLPenalty",
    "LossInputs",
    "OPDLoss",
    "PolicyLoss",
    "ReinforcePPLoss",
    "TIS",
    "TeacherKL",
    "aggregate",
    "kl_estimate",
]
