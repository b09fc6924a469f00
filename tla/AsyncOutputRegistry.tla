------------------------ MODULE AsyncOutputRegistry -------------------------
(***************************************************************************)
(* The registry's operators: pure functions on one id's record (Rec), one  *)
(* per step of omni_async.core.registry.OutputRegistry (see                *)
(* spec/PROTOCOL.md).  RequestNext is only defined on the table's pairs,   *)
(* so an illegal event is an evaluation error in TLC, as it is an          *)
(* AssertionError in OutputRegistry._fire.                                 *)
(***************************************************************************)
EXTENDS AsyncOutputState

RFire(x, e) == [x EXCEPT !.st = RequestNext(x.st, e)]

ReleaseSeg(x) == [x EXCEPT !.seg = "released", !.frees = @ + 1]

\* _discard_payload: a held output's segment goes back to the pool.
Discard(x) ==
    IF x.held \in Ids THEN [ReleaseSeg(x) EXCEPT !.held = NoId]
    ELSE [x EXCEPT !.held = NoId]

\* _fail_waiter: the engine's future gets an error (a cancelled one is skipped).
FailWaiter(x) ==
    CASE x.waiter = "waiting"   -> [x EXCEPT !.waiter = "none", !.eng = "done", !.nres = @ + 1]
      [] x.waiter = "cancelled" -> [x EXCEPT !.waiter = "none"]
      [] OTHER                  -> x

\* The engine's future is claimed and gets the output (or its failure).
Deliver(x) ==
    LET y == RFire([x EXCEPT !.waiter = "none", !.held = NoId, !.nres = @ + 1], "DELIVER") IN
    IF x.held \in Ids
    THEN [y EXCEPT !.eng = "holding", !.got = x.held, !.seg = "consumer"]
    ELSE [y EXCEPT !.eng = "done"]

\* A waiter and a result meet, but the Future was cancelled first (F3).
ClaimFails(x) == x.waiter = "cancelled" /\ x.st \in {"READY", "FAILED"}

\* The record goes the moment it is terminal; its tombstone ("fin", plus the
\* messages it has not seen: see ForceRelease) tells a late or repeated
\* message of a finished id from a new id (OutputRegistry._finished).
Remove(x) == IF x.st \in RequestTerminal THEN [x EXCEPT !.st = "NONE", !.late = {"fin"}] ELSE x

\* _after_change: deliver if a waiter and a result meet; remove a terminal record.
AfterChange(x) ==
    Remove(CASE x.waiter = "waiting" /\ x.st \in {"READY", "FAILED"} -> Deliver(x)
             [] ClaimFails(x) -> Discard(RFire([x EXCEPT !.waiter = "none"], "ABANDON"))
             [] OTHER -> x)

\* _abandon: the waiter goes, and the output with it (a late one is released
\* on arrival: F9).
Abandon(x) == AfterChange(Discard(RFire(x, "ABANDON")))

\* drop: the waiter fails, a cached output goes (F10).
Drop(x) ==
    IF x.st = "NONE" THEN x
    ELSE AfterChange(Discard(RFire([FailWaiter(x) EXCEPT !.dropped = TRUE], "DROP")))

Create(x) == IF x.st = "NONE" THEN [x EXCEPT !.st = RegistryInitial] ELSE x

\* _late_message: a message of a finished id.  The tombstone swallows one it
\* still expects (after a force-release only: everywhere else an id ends
\* once both of its messages have arrived); any other is a protocol error.
\* A closed registry creates no record (_get_or_create): a message of an id
\* it never saw is skipped.
Late(x, kind) == x.st = "NONE" /\ kind \in x.late
Unexpected(x, kind) == x.st = "NONE" /\ "fin" \in x.late /\ kind \notin x.late
Skipped(x) == x.st = "NONE" /\ "fin" \notin x.late /\ closed

\* on_compute_done for one id: accepted, swallowed (late), skipped (closed),
\* or refused (a duplicate, or unexpected for a finished id: protocol error).
CdLate(x) == Late(x, "cd")
CdAccepted(x) ==
    /\ ~CdLate(x) /\ ~Unexpected(x, "cd") /\ ~Skipped(x)
    /\ Create(x).st \in RequestAwaitingComputeDone
CdRefused(x) == ~CdLate(x) /\ ~Skipped(x) /\ ~CdAccepted(x)
OnComputeDone(x) ==
    IF CdLate(x) THEN [x EXCEPT !.late = @ \ {"cd"}]
    ELSE IF CdAccepted(x) THEN AfterChange(RFire(Create(x), "COMPUTE_DONE"))
    ELSE x

\* on_output, before _after_change.
OutEvent(ok) == IF ok THEN "OUTPUT_READY" ELSE "OUTPUT_FAILED"
OutLate(x) == Late(x, "out")
OutRefused(x, ok) ==
    /\ ~OutLate(x) /\ ~Skipped(x)
    /\ Unexpected(x, "out") \/ ~RequestCan(Create(x).st, OutEvent(ok))
Arrive(x, ok, out) ==
    LET y == RFire(Create(x), OutEvent(ok)) IN
    IF y.st \in RequestHolding THEN [y EXCEPT !.held = IF ok THEN out ELSE "failure"]
    ELSE IF ok THEN ReleaseSeg(y)          \* nobody wants it: released on arrival (F9, F10)
    ELSE y
OnOutput(x, ok, out) ==
    IF OutLate(x) THEN (IF ok THEN ReleaseSeg([x EXCEPT !.late = @ \ {"out"}]) ELSE [x EXCEPT !.late = @ \ {"out"}])
    ELSE IF Skipped(x) \/ OutRefused(x, ok) THEN (IF ok THEN ReleaseSeg(x) ELSE x)
    ELSE AfterChange(Arrive(x, ok, out))

\* The messages a live record has not seen yet (what its tombstone expects).
Unseen(x) ==
    (IF x.st \in RequestAwaitingComputeDone THEN {"cd"} ELSE {})
    \cup (IF x.st \in {"COMPUTE_DONE", "DROPPING", "RELEASING"} THEN {"out"} ELSE {})

\* One record force-released: its waiter fails, its payload goes, its
\* tombstone expects what it has not seen.
ForceRelease1(x) ==
    [AfterChange(Discard(RFire(FailWaiter(x), "FORCE_RELEASE"))) EXCEPT !.late = {"fin"} \cup Unseen(x)]

\* fail_all: every waiter fails, every record is force-released, its cached
\* output with it (F16).
ForceRelease(x) == IF x.st = "NONE" THEN x ELSE ForceRelease1(x)

\* expire, for a record still waiting for its COMPUTE_DONE (an early
\* OUTPUT_READY created it): force-released, its tombstone expects the
\* COMPUTE_DONE (OutputRegistry._orphan).
ExpireEarly(x) == ForceRelease1(x)

\* expire, for a DROPPING record that a COMPUTE_DONE of a call never made
\* announced: no worker packs its output, which may never come, so it is
\* given up on: force-released, its tombstone swallows an OUTPUT_READY still
\* to come (OutputRegistry._give_up, M6).
ExpireGhost(x) == ForceRelease1(x)

\* expire, for one record whose deadline passed: abandoned once its
\* COMPUTE_DONE arrived (the output deadline), else orphaned; given up on if
\* a call never made announced it.
Expire1(x) ==
    LET y == IF x.st \in RequestAwaitingComputeDone THEN ExpireEarly(x)
             ELSE IF x.ghost /\ x.st = "DROPPING" THEN ExpireGhost(x)
             ELSE Abandon(FailWaiter(x))
    IN [y EXCEPT !.gaveUp = TRUE]

=============================================================================
