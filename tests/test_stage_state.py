"""`topp_rl.megatron.stage_state`: optimizer state regrouped by parameter name for another pipeline size, on toy
modules named like megatron's GPTModel (the real schedule's case is in test_megatron_pipeline.py)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from topp_rl.megatron.stage_state import global_param_names, restage


class _Stage(nn.Module):
    """A backbone holding `model` with layers `layers` of a 4-layer toy model; the first stage has the embedding,
    the last the final norm and (untied, or a tied copy) the output layer."""

    def __init__(self, layers: range, *, first: bool, last: bool, output: bool) -> None:
        super().__init__()
        self.model = nn.Module()
        if first:
            self.model.embedding = nn.Module()
            self.model.embedding.word_embeddings = nn.Embedding(5, 3)
        self.model.decoder = nn.Module()
        self.model.decoder.layers = nn.ModuleList(nn.Linear(3, 3) for _ in layers)
        if last:
            self.model.decoder.final_layernorm = nn.LayerNorm(3)
        if output:
            self.model.output_layer = nn.Linear(3, 5, bias=False)
        if first and output:  # the backbone's own attribute for the tied copy (MegatronBackbone.tied_copy)
            self.tied_copy = self.model.embedding.word_embeddings.weight
        self.chunks, self.places = [self.model], [SimpleNamespace(layers=layers)]  # one chunk: the stage


def _stepped(stage: nn.Module, seed: int) -> dict:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(stage.parameters(), lr=0.1)
    for p in stage.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict()


def test_names_are_global_and_skip_the_backbones_own_alias():
    stage1 = _Stage(range(2, 4), first=False, last=True, output=True)
    assert global_param_names(stage1) == [
        "model.decoder.layers.2.weight", "model.decoder.layers.2.bias", "model.decoder.layers.3.weight",
        "model.decoder.layers.3.bias", "model.decoder.final_layernorm.weight", "model.decoder.final_layernorm.bias",
        "model.output_layer.weight"]
    tied_whole = _Stage(range(4), first=True, last=True, output=False)
    tied_whole.tied_copy = tied_whole.model.embedding.word_embeddings.weight
    assert global_param_names(tied_whole)[0] == "model.embedding.word_embeddings.weight"


def test_two_stages_regroup_into_one_and_back():
    stages = [_Stage(range(0, 2), first=True, last=False, output=False),
              _Stage(range(2, 4), first=False, last=True, output=True)]
    saved = [(global_param_names(s), _stepped(s, seed=i)) for i, s in enumerate(stages)]
    whole = _Stage(range(4), first=True, last=True, output=True)
    names = global_param_names(whole)
    merged = restage(saved, names)
    by_name = {n: st["state"][i] for n, st in saved for i, n in enumerate(n)}
    assert merged["param_groups"][0]["params"] == list(range(len(names)))
    assert merged["param_groups"][0]["lr"] == 0.1
    for i, name in enumerate(names):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(merged["state"][i][key], by_name[name][key]), (name, key)
    torch.optim.AdamW(whole.parameters(), lr=0.1).load_state_dict(merged)  # torch accepts it
    # and split again: stage 1 takes back exactly its own
    back = restage([(names, merged)], global_param_names(stages[1]))
    assert all(torch.equal(back["state"][i]["exp_avg"], saved[1][1]["state"][i]["exp_avg"]) for i in range(7))


def test_a_tied_copy_takes_the_embeddings_state_and_a_missing_parameter_is_refused():
    tied_whole = _Stage(range(4), first=True, last=True, output=False)
    saved = [(global_param_names(tied_whole), _stepped(tied_whole, seed=0))]
    last = _Stage(range(2, 4), first=False, last=True, output=True)  # its output layer: the tied copy
    state = restage(saved, global_param_names(last))
    assert torch.equal(state["state"][6]["exp_avg"], saved[0][1]["state"][0]["exp_avg"])  # the embedding's
    untied_last = [(global_param_names(last), _stepped(last, seed=1))]
    with pytest.raises(ValueError, match="parameter model.embedding.word_embeddings.weight of this pipeline stage "
                                         "is in none of the saved stages' optimizer states"):
        restage(untied_last, global_param_names(tied_whole))


def test_stages_with_other_hyper_parameters_are_refused():
    stages = [_Stage(range(0, 2), first=True, last=False, output=False),
              _Stage(range(2, 4), first=False, last=True, output=True)]
    saved = [(global_param_names(s), _stepped(s, seed=i)) for i, s in enumerate(stages)]
    saved[1][1]["param_groups"][0]["lr"] = 0.2
    with pytest.raises(ValueError, match="the saved stages' optimizer hyper-parameters differ"):
        restage(saved, global_param_names(_Stage(range(4), first=True, last=True, output=True)))
