----------------------------- MODULE TraceEngine -----------------------------
(***************************************************************************)
(* Trace validation of engine runs: TLC checks that traces recorded by the *)
(* engine (one EngineFire or StageFire event per machine transition, on    *)
(* its event-loop thread, in order) are behaviours of EngineLifecycle, the *)
(* model-checked spec itself.                                              *)
(*                                                                         *)
(* omni_async.verify.enginetrace writes the module TraceEngineData next to *)
(* this one:                                                               *)
(*   TraceLog   the events of every trace, one after the other, each trace *)
(*              closed by an "End" event; an event is a record [a:         *)
(*              "EngineFire", "StageFire" or "End", r: the request ("-"    *)
(*              for the engine), e: event, s: source, d: target];          *)
(*   NumTraces, TNumReqs, TStreams, TCloses   per trace: how many requests *)
(*              (renumbered "1", "2", ... in order of first appearance),   *)
(*              which of them streamed (a STREAM_RESULT), how many close() *)
(*              calls (engine CLOSE events): the constants of its INSTANCE *)
(*              of EngineLifecycle.                                        *)
(*                                                                         *)
(* The state is EngineLifecycle's own.  A step is one step of              *)
(* EngineLifecycle's Next (or CloseRequestAgain, the table's self-loop a   *)
(* close may also fire): a step that fires a machine event must fire the   *)
(* next recorded one (machine, request, event, source, target); a step     *)
(* that fires nothing (the factory's thread, the data and control paths,   *)
(* a driver's withdrawal or cancel, close's shutdown, ...) is not          *)
(* recorded, and TLC searches all of them.  Requests are generated in the  *)
(* order of their numbers (generate commutes with every other step, so     *)
(* this loses no behaviour and keeps the search small).                    *)
(*                                                                         *)
(* A trace is accepted when some behaviour consumes all of it: TLC then    *)
(* reports the invariant Unfinished violated, which the checker reads as   *)
(* success.  When no behaviour does, TLC completes without error; TLCSet   *)
(* register 1 holds the most events any behaviour consumed, printed each   *)
(* time it grows ("TraceEngine reached n"): the event after it is the one  *)
(* no behaviour of the model explains.                                     *)
(***************************************************************************)
EXTENDS Integers, Sequences, TLC, EngineTable, TraceEngineData

ASSUME TLCSet(1, 0)

VARIABLES
    l,    \* events consumed
    tr,   \* the trace being replayed
    eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk,
    cancelSent, dataQ, ctrlQ, ioBusy, fired

model == <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk,
           cancelSent, dataQ, ctrlQ, ioBusy, fired>>
vars == <<l, tr, model>>

Id(i) == ToString(i)
ReqsOf(t) == {Id(i) : i \in 1..TNumReqs[t]}

M(t) == INSTANCE EngineLifecycle WITH
    Reqs <- ReqsOf(t), Blockers <- ReqsOf(t), Streams <- {Id(i) : i \in TStreams[t]},
    Closes <- 1..TCloses[t], FactoryFails <- TRUE

NoFire == [m |-> "none", r |-> "-", e |-> "", s |-> "", d |-> ""]

Ev == TraceLog[l + 1]

Matches(f, ev) ==
    /\ f.m = (IF ev.a = "EngineFire" THEN "engine" ELSE "stage")
    /\ f.r = ev.r /\ f.e = ev.e /\ f.s = ev.s /\ f.d = ev.d

\* Requests are generated in the order of their numbers.
GeneratedInOrder(t) ==
    \A i \in 1..TNumReqs[t] :
        (stage[Id(i)] = "NONE" /\ stage'[Id(i)] # "NONE") => \A j \in 1..(i - 1) : stage[Id(j)] # "NONE"

ModelStep(t) ==
    \/ M(t)!Next
    \/ \E c \in 1..TCloses[t], r \in ReqsOf(t) : M(t)!CloseRequestAgain(c, r)

\* The most events any behaviour consumed so far (see the header).
Reached ==
    IF l' > TLCGet(1) THEN TLCSet(1, l') /\ PrintT(<<"TraceEngine reached", l'>>) ELSE TRUE

Replay ==
    /\ l < Len(TraceLog) /\ Ev.a # "End"
    /\ \E t \in {tr} : ModelStep(t) /\ GeneratedInOrder(t)
    /\ IF fired' = NoFire THEN l' = l ELSE Matches(fired', Ev) /\ l' = l + 1
    /\ UNCHANGED tr
    /\ Reached

\* The initial state of trace t, primed (TLC cannot assign through a primed Init).
InitNext(t) ==
    /\ eng' = EngineInitial
    /\ stage' = [r \in ReqsOf(t) |-> "NONE"]
    /\ startPc' = "idle" /\ factory' = "idle" /\ exec' = "none" /\ owned' = FALSE
    /\ closePc' = [c \in 1..TCloses[t] |-> "idle"] /\ closedEvt' = FALSE
    /\ callPc' = [r \in ReqsOf(t) |-> "idle"]
    /\ net' = [r \in ReqsOf(t) |-> "none"] /\ wk' = [r \in ReqsOf(t) |-> "none"]
    /\ cancelSent' = [r \in ReqsOf(t) |-> FALSE]
    /\ dataQ' = <<>> /\ ctrlQ' = <<>> /\ ioBusy' = "-"
    /\ fired' = NoFire

\* The end of a trace (a run may stop anywhere); the next one starts fresh.
TraceEnd ==
    /\ l < Len(TraceLog) /\ Ev.a = "End"
    /\ l' = l + 1
    /\ IF tr < NumTraces THEN tr' = tr + 1 /\ InitNext(tr + 1) ELSE UNCHANGED <<tr, model>>
    /\ Reached

Init == l = 0 /\ tr = 1 /\ M(1)!Init

Next == Replay \/ TraceEnd

Spec == Init /\ [][Next]_vars

\* Violated exactly when every trace has been consumed: success.
Unfinished == l < Len(TraceLog)

=============================================================================
