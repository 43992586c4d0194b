"""A stand-in reward for the ExGRPO CI run (tests/test_exgrpo.py): the tiny random model solves no arithmetic,
so "correct" is a deterministic property of the text instead (an even number of characters). About half the
samples of a group pass, so groups with 0 < k < n occur and the replay buffer gets entries; a replayed sample
(the same text) passes again."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    ok = float(len(solution_str) % 2 == 0)
    return {"score": ok, "acc": ok}
