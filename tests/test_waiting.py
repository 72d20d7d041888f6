"""The batcher's queue of waiting requests against a plain list: its order, membership and each request's waiting
forks after any sequence of arrivals, preemptions (back at the head) and departures."""

from hypothesis import given, settings
from hypothesis import strategies as st

from jlora.scheduler import Request, _Waiting

# (0, source, at_head): a request arrives, a fork of request `source` (modulo those made) or of none; (1, i): the
# waiting request i (modulo those waiting) leaves
_OPS = st.lists(st.one_of(st.tuples(st.just(0), st.none() | st.integers(0, 50), st.booleans()),
                          st.tuples(st.just(1), st.integers(0, 50))), max_size=80)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ops=_OPS)
def test_the_queue_answers_as_a_list_scanned_in_order(ops):
    queue, truth, made = _Waiting(), [], []
    for op in ops:
        if op[0] == 0:
            _, source, at_head = op
            r = Request([1, 2], -1, 1, fork_of=made[source % len(made)] if made and source is not None else None)
            made.append(r)
            queue.append(r, at_head=at_head)
            truth.insert(0 if at_head else len(truth), r)
        elif truth:
            r = truth.pop(op[1] % len(truth))
            queue.remove(r)
        assert list(queue) == truth and len(queue) == len(truth) and bool(queue) == bool(truth)
        assert (queue.head is truth[0]) if truth else True
        for r in made:
            assert (r in queue) == (r in truth)
            assert queue.forks_of(r) == [f for f in truth if f.fork_of is r]
