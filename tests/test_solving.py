"""The ILPs' constraints and objectives written straight into CP-SAT's proto
(``planner.solving.add_linear``, ``minimize``) are the ones CP-SAT's
expression API writes, so the models, and their solutions, are the same."""
from ortools.sat.python import cp_model

from tfpar.planner.solving import add_linear, minimize

INT_MIN, INT_MAX = cp_model.INT_MIN, cp_model.INT_MAX


def _protos(write_by_api, write_directly):
    models = []
    for write in (write_by_api, write_directly):
        model = cp_model.CpModel()
        xs = [model.NewBoolVar(f"x{i}") for i in range(4)] + [model.NewIntVar(0, 5, "s")]
        write(model, xs)
        models.append(model.Proto().SerializeToString(deterministic=True))
    return models


def test_linear_constraints_are_the_expression_apis():
    def by_api(model, xs):
        model.Add(sum(xs[:3]) == xs[3])                                 # a pair's sum
        model.Add(xs[4] - xs[0] >= xs[1])                               # a stage edge
        model.Add(xs[4] - xs[0] <= 3 * xs[1])
        model.Add(xs[4] == sum(s * x for s, x in enumerate(xs[:4])))    # 0 x x0 left out
        model.Add(sum(w * x for w, x in zip([0, 5, 7, 0], xs)) <= 9)   # a stage's work
        model.Add(sum(0 * x for x in xs) <= 9)                          # constant: true

    def directly(model, xs):
        add_linear(model, [(1, x) for x in xs[:3]] + [(-1, xs[3])], 0, 0)
        add_linear(model, [(1, xs[4]), (-1, xs[0]), (-1, xs[1])], low=0)
        add_linear(model, [(1, xs[4]), (-1, xs[0]), (-3, xs[1])], high=0)
        add_linear(model, [(1, xs[4])] + [(-s, x) for s, x in enumerate(xs[:4])], 0, 0)
        add_linear(model, list(zip([0, 5, 7, 0], xs)), high=9)
        add_linear(model, [(0, x) for x in xs], high=9)
    api, direct = _protos(by_api, directly)
    assert api == direct


def test_objectives_are_the_expression_apis():
    def by_api(model, xs):
        model.Minimize(sum(c * x for c, x in zip([3, 0, 5, 2, 1], xs)))

    def directly(model, xs):
        minimize(model, list(zip([3, 0, 5, 2, 1], xs)))
    api, direct = _protos(by_api, directly)
    assert api == direct

    def nothing_by_api(model, xs):
        model.Minimize(sum(0 * x for x in xs))

    def nothing(model, xs):
        minimize(model, [(0, x) for x in xs])
    api, direct = _protos(nothing_by_api, nothing)
    assert api == direct
