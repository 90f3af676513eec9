"""The residency planner's arithmetic (qse/core/residency.py): claims, shared weights, what is available."""

from qse.core.residency import GIB, Claim, Residency, RoleState, admit, committed_nbytes

SERVED = Claim("served", "served:m9", 18 * GIB, (("kv_pool", 8 * GIB), ("session_cache", 6 * GIB)))
READER = Claim("reader", "reader:m08", 2 * GIB, (("kv_pool", 4 * GIB), ("session_cache", 4 * GIB)))
SHARED_READER = Claim("reader", "served:m9", 18 * GIB, (("kv_pool", 4 * GIB),))


def test_a_claim_that_fits_is_admitted_and_counts_what_the_loaded_roles_have_not_drawn_yet():
    # 40 GiB free; the served model claimed 32 and drew 26: 6 are still owed to it, so 34 are available
    verdict = admit(READER, [SERVED], free_nbytes=40 * GIB, drawn_nbytes=26 * GIB)
    assert verdict.fits and verdict.need_nbytes == 10 * GIB and verdict.available_nbytes == 34 * GIB
    assert verdict.shares_weights_with is None


def test_a_claim_that_does_not_fit_is_refused_naming_the_role_its_claim_and_the_free_memory():
    verdict = admit(READER, [SERVED], free_nbytes=12 * GIB, drawn_nbytes=26 * GIB, where="cuda:0")
    assert not verdict.fits and verdict.available_nbytes == 6 * GIB
    assert verdict.message.startswith("the reader's claim (weights 2.00 GiB + kv_pool 4.00 GiB + session_cache "
                                      "4.00 GiB) needs 10.00 GiB, but cuda:0 has 12.00 GiB free, 6.00 GiB of it "
                                      "claimed by the loaded roles: 6.00 GiB available")


def test_roles_on_one_model_count_its_weights_once():
    verdict = admit(SHARED_READER, [SERVED], free_nbytes=5 * GIB, drawn_nbytes=32 * GIB)
    assert verdict.fits and verdict.need_nbytes == 4 * GIB and verdict.shares_weights_with == "served"
    assert "weights shared with the served" in verdict.message
    assert committed_nbytes([SERVED, SHARED_READER]) == 18 * GIB + 14 * GIB + 4 * GIB


def test_on_a_cpu_budget_every_loaded_claim_counts():
    """drawn 0 (a CPU budget): available is the budget less every loaded claim."""
    verdict = admit(READER, [SERVED], free_nbytes=40 * GIB)
    assert not verdict.fits and verdict.available_nbytes == 8 * GIB


def test_the_book_notes_a_refusal_a_load_a_release_and_the_measured_weights():
    book = Residency()
    book.plan(SERVED, RoleState.LOADED)
    book.plan(Claim("reader", "reader:x", None, (("kv_pool", GIB),)))
    assert book.state("narrator") is RoleState.OFF and book.state("reader") is RoleState.PLANNED
    assert not book.admit("reader", free_nbytes=GIB // 2, drawn_nbytes=32 * GIB).fits
    assert book.state("reader") is RoleState.REFUSED
    assert "weights unknown until loaded" in book.view()["reader"]["verdict"]
    assert book.admit("reader", free_nbytes=2 * GIB, drawn_nbytes=32 * GIB).fits
    book.set_state("reader", RoleState.LOADED)
    book.measured("reader", 3 * GIB)
    assert book.view()["reader"] == {"state": "loaded", "model": "reader:x", "weights_bytes": 3 * GIB,
                                     "pools": {"kv_pool": GIB}, "claim_bytes": 4 * GIB, "shares_weights_with": None,
                                     "verdict": book.roles["reader"].verdict.message}
    assert [c.role for c in book.loaded()] == ["served", "reader"]
    book.set_state("reader", RoleState.RELEASED)
    assert [c.role for c in book.loaded()] == ["served"]
