"""Prompt lookup's proposer: the longest recurring suffix (prompt_lookup_max down to
prompt_lookup_min tokens) proposes what followed its latest earlier occurrence, from an
index that grows with the sequence; the speculator's back-off, eligibility and config."""

from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.core.sequence import Sequence
from engine.speculative.acceptance import accepted_tokens
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram_proposer import NgramIndex
from engine.speculative.speculator import MAX_BACK_OFF_STEPS, Speculator, can_speculate


def test_the_longest_recurring_suffix_wins_over_a_shorter_more_recent_one():
    # Suffix [1, 2, 3] occurred at 0..2 (followed by 7, 8); [2, 3] alone last at 5..6 (then 9).
    tokens = [1, 2, 3, 7, 8, 2, 3, 9, 1, 2, 3]
    assert NgramIndex(1, 3).propose(tokens, 2) == [7, 8]
    assert NgramIndex(1, 2).propose(tokens, 2) == [9, 1]


def test_the_latest_earlier_occurrence_is_proposed_never_the_suffix_itself():
    tokens = [4, 5, 6, 4, 5, 7, 4, 5]
    assert NgramIndex(2, 2).propose(tokens, 3) == [7, 4, 5]
    assert NgramIndex(2, 2).propose(tokens, 4) == [7, 4, 5, 7]
    assert NgramIndex(2, 2).propose([4, 5], 3) == []  # its only occurrence is itself


def test_a_match_shorter_than_prompt_lookup_min_proposes_nothing():
    tokens = [1, 2, 9, 8, 7, 2]  # only [2] recurs
    assert NgramIndex(2, 4).propose(tokens, 3) == []
    assert NgramIndex(1, 4).propose(tokens, 3) == [9, 8, 7]


def test_proposals_past_the_sequence_end_repeat_with_the_matchs_period_up_to_num_tokens():
    tokens = [1, 2, 3, 1, 2]  # [1, 2] recurs 3 tokens later: a loop of 3
    assert NgramIndex(1, 2).propose(tokens, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert NgramIndex(1, 2).propose(tokens, 1) == [3]
    assert NgramIndex(1, 3).propose([9, 5, 5], 4) == [5, 5, 5, 5]  # a run of one token


def test_the_index_grows_incrementally_and_proposes_as_one_built_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
    grown = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        assert grown.propose(tokens[:end], 3) == NgramIndex(1, 3).propose(tokens[:end], 3), end
    assert grown._num_indexed == len(tokens) - 1  # each position indexed once, as it came


def test_kept_tokens_run_to_the_first_rejected_proposal_and_its_draw():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accepted_tokens([], [4]) == [4]


def sequence(tokens: list[int], params: SamplingParams = SamplingParams(max_tokens=50, temperature=0)) -> Sequence:
    seq = Sequence("s", tokens[:2], params, block_size=16)
    for token in tokens[2:]:
        seq.append_token(token, None)
    return seq


def test_a_sequence_whose_proposals_all_fail_backs_off_longer_each_time():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1), max_model_len=1024)
    seq = sequence([1, 2, 1, 2, 1])
    assert speculator.propose(seq, 8) == [2, 1]
    skipped = []
    for _ in range(3):
        speculator.record(seq, 2, 0)
        num_skipped = 0
        while not speculator.propose(seq, 8):
            num_skipped += 1
        skipped.append(num_skipped)
    assert skipped == [1, 3, 7]
    speculator.record(seq, 2, 1)  # one kept: proposing again at once
    assert speculator.propose(seq, 8) == [2, 1]
    for _ in range(10):
        speculator.record(seq, 2, 0)
    assert seq.draft_state.num_skipped_left == MAX_BACK_OFF_STEPS
    assert (speculator.num_proposed_tokens, speculator.num_accepted_tokens) == (28, 1)


def test_proposals_leave_room_for_the_drawn_token_within_max_tokens():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=5), max_model_len=1024)
    seq = sequence([1, 2, 1, 2, 1, 2, 1], SamplingParams(max_tokens=8, temperature=0))  # 5 output tokens
    assert speculator.propose(seq, 8) == [2, 1]  # 2 more + the drawn one = 8
    assert speculator.row_budget(num_decodes=10) == 6 and speculator.row_budget(num_decodes=20) == 0


@pytest.mark.parametrize("params, speculates", [
    (SamplingParams(temperature=0), True),
    (SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.01, logit_bias={3: 1.0}, stop=["x"]), True),
    (SamplingParams(temperature=0, logprobs=0), False),
    (SamplingParams(temperature=0, presence_penalty=0.5), False),
    (SamplingParams(temperature=0, repetition_penalty=1.2), False),
    (SamplingParams(temperature=0, min_tokens=10), False),  # 3 output tokens: its ban still holds
])
def test_only_requests_whose_rows_sample_independently_speculate(params, speculates):
    assert can_speculate(sequence([1, 2, 3, 4, 5], params)) is speculates


def test_a_config_file_mapping_becomes_a_validated_speculative_config():
    config = EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5})
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=5)
    assert EngineConfig().speculative == SpeculativeConfig()  # on by default, vLLM's n-gram settings
    assert SpeculativeConfig() == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    assert EngineConfig(speculative=None).speculative is None  # a config file's null: off
    for bad in ({"method": "eagle"}, {"num_speculative_tokens": 0}, {"prompt_lookup_min": 5, "prompt_lookup_max": 2},
                {"lookahead": 3}):
        with pytest.raises(ValueError):
            EngineConfig(speculative=bad)
