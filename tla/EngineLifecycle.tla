--------------------------- MODULE EngineLifecycle ---------------------------
(***************************************************************************)
(* The engine's lifecycle and abort (issue 17): AsyncDiffusionEngine's     *)
(* actors around its two machines, the lifecycle and each request's        *)
(* stages (core/engine_states.py, generated into EngineTable).             *)
(*                                                                         *)
(* Actors:                                                                 *)
(*   the caller's start(): fires START, runs the factory in a thread and   *)
(*     awaits it; the caller may cancel start() while the factory runs     *)
(*     (the thread keeps running and may still build the executor);        *)
(*   the factory's thread: builds the executor (live) or raises;           *)
(*   close(), called up to |Closes| times, concurrently with start or not; *)
(*   the caller's generate / abort(wait=True) / leaving, per request;      *)
(*   a driver per request: sends it on the DATA path (one I/O thread, a    *)
(*     send that may block for ever: a full pipe), sends its cancel or     *)
(*     drop on the CONTROL path, and fires its remaining stages;           *)
(*   the worker (the executor's side): runs a forward (it may never end by *)
(*     itself: only a cancel ends it), fails it, holds its output;         *)
(*   the control path's thread.                                            *)
(*                                                                         *)
(* Every engine or request state change is EngineFire / StageFire: an      *)
(* entry of the generated tables, nothing else.  `fired` records the       *)
(* machine step an action took (none for the others): trace validation     *)
(* (TraceEngine.tla) matches it against the recorded events; View leaves   *)
(* it out, so it costs model checking nothing.                             *)
(*                                                                         *)
(* The buggy variants (defects 1-3 and 5 of issue 17) are in               *)
(* MCEngineBugs.tla: each replaces one action through NextWith.            *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, EngineTable

CONSTANTS
    Reqs,          \* the requests the caller may generate
    Blockers,      \* (subset of Reqs) those whose data send may block for ever
    Streams,       \* (subset of Reqs) those served as a stream (STREAM_RESULT)
    Closes,        \* the close() calls the caller may make
    FactoryFails   \* BOOLEAN: the factory may raise

ASSUME Blockers \subseteq Reqs /\ Streams \subseteq Reqs /\ FactoryFails \in BOOLEAN

VARIABLES
    eng,         \* the engine's lifecycle machine
    stage,       \* [Reqs -> StageStates \cup {"NONE"}] ("NONE": not generated)
    startPc,     \* start(): "idle", "await" (the factory runs), "cancelled" (its handler runs), "done"
    factory,     \* the factory's thread: "idle", "running", "built", "failed"
    exec,        \* the executor the factory built: "none", "live", "shut"
    owned,       \* the engine holds that executor (what close shuts down)
    closePc,     \* [Closes -> CloseSteps]
    closedEvt,   \* the event a waiting close() waits on is set
    callPc,      \* [Reqs -> {"idle", "waiting", "returned", "left"}]: abort(r, wait=True), or the caller left
    net,         \* [Reqs -> NetStates]: its data send
    wk,          \* [Reqs -> {"none", "run", "out", "gone"}]: its forward, its output, on the worker side
    cancelSent,  \* [Reqs -> BOOLEAN]: its driver sent its cancel
    dataQ,       \* the data path's queue: <<[k |-> "data" or "cancel", r |-> request], ...>>
    ctrlQ,       \* the control path's queue: <<request, ...>> (cancels and drops)
    ioBusy,      \* the request whose send blocks the I/O thread ("-": none)
    fired        \* the machine step of the last action (trace validation)

CloseSteps == {"idle", "waitstart", "abortall", "shutdown", "drain", "wait", "returned"}
NetStates == {"none", "queued", "stuck", "sent", "withdrawn", "broken"}

vars == <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk,
          cancelSent, dataQ, ctrlQ, ioBusy, fired>>
View == <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk,
          cancelSent, dataQ, ctrlQ, ioBusy>>

NoFire == [m |-> "none", r |-> "-", e |-> "", s |-> "", d |-> ""]
Live(r) == stage[r] \notin {"NONE"} \cup StageTerminal
Ending(r) == stage[r] \in StageEnding
OnWorker(r) == wk[r] \in {"run", "out"}
Queued(r) == \E i \in 1..Len(dataQ) : dataQ[i].r = r
CancelQueued(r) == \/ \E i \in 1..Len(ctrlQ) : ctrlQ[i] = r
                   \/ \E i \in 1..Len(dataQ) : dataQ[i] = [k |-> "cancel", r |-> r]
CloseCalled == \E c \in Closes : closePc[c] # "idle"

TypeOK ==
    /\ eng \in EngineStates
    /\ stage \in [Reqs -> StageStates \cup {"NONE"}]
    /\ startPc \in {"idle", "await", "cancelled", "done"}
    /\ factory \in {"idle", "running", "built", "failed"}
    /\ exec \in {"none", "live", "shut"}
    /\ owned \in BOOLEAN
    /\ closePc \in [Closes -> CloseSteps]
    /\ closedEvt \in BOOLEAN
    /\ callPc \in [Reqs -> {"idle", "waiting", "returned", "left"}]
    /\ net \in [Reqs -> NetStates]
    /\ wk \in [Reqs -> {"none", "run", "out", "gone"}]
    /\ cancelSent \in [Reqs -> BOOLEAN]
    /\ ioBusy \in Reqs \cup {"-"}

Init ==
    /\ eng = EngineInitial
    /\ stage = [r \in Reqs |-> "NONE"]
    /\ startPc = "idle" /\ factory = "idle" /\ exec = "none" /\ owned = FALSE
    /\ closePc = [c \in Closes |-> "idle"] /\ closedEvt = FALSE
    /\ callPc = [r \in Reqs |-> "idle"]
    /\ net = [r \in Reqs |-> "none"] /\ wk = [r \in Reqs |-> "none"]
    /\ cancelSent = [r \in Reqs |-> FALSE]
    /\ dataQ = <<>> /\ ctrlQ = <<>> /\ ioBusy = "-"
    /\ fired = NoFire

\* The only ways a machine moves: an entry of the generated tables.
EngineFire(e) ==
    /\ EngineCan(eng, e)
    /\ eng' = EngineNext(eng, e)
    /\ fired' = [m |-> "engine", r |-> "-", e |-> e, s |-> eng, d |-> EngineNext(eng, e)]
StageFire(r, e) ==
    /\ StageCan(stage[r], e)
    /\ stage' = [stage EXCEPT ![r] = StageNext(@, e)]
    /\ fired' = [m |-> "stage", r |-> r, e |-> e, s |-> stage[r], d |-> StageNext(stage[r], e)]
Silent == fired' = NoFire

-----------------------------------------------------------------------------
(* start(), the factory's thread                                           *)

\* start() on a NEW engine fires START and hands the factory to a thread;
\* on any other it is refused (no state change).
CallStart ==
    /\ startPc = "idle"
    /\ IF eng = "NEW"
       THEN /\ EngineFire("START") /\ startPc' = "await" /\ factory' = "running"
       ELSE /\ Silent /\ startPc' = "done" /\ UNCHANGED <<eng, factory>>
    /\ UNCHANGED <<stage, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>

\* The factory's thread: it runs on whatever happens to start().
FactoryRun ==
    /\ factory = "running"
    /\ \/ factory' = "built" /\ exec' = "live"
       \/ FactoryFails /\ factory' = "failed" /\ UNCHANGED exec
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, owned, closePc, closedEvt, callPc, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>

\* The caller cancels start() while it awaits the factory.
CancelStart ==
    /\ startPc = "await" /\ startPc' = "cancelled"
    /\ Silent
    /\ UNCHANGED <<eng, stage, factory, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

\* The await returned.  A failed factory: START_FAILED (FAILED, or CLOSING
\* stays CLOSING under a close).  A built executor: STARTED while STARTING;
\* under a close (CLOSING), start shuts down what it built and gives up.
StartFinish ==
    /\ startPc = "await" /\ factory \in {"built", "failed"}
    /\ startPc' = "done"
    /\ CASE factory = "failed" ->
              /\ EngineFire("START_FAILED")
              /\ closedEvt' = (closedEvt \/ eng' \in EngineTerminal)
              /\ UNCHANGED <<exec, owned>>
         [] eng = "STARTING" ->
              /\ EngineFire("STARTED") /\ owned' = TRUE
              /\ UNCHANGED <<exec, closedEvt>>
         [] OTHER ->
              /\ EngineFire("START_FAILED") /\ exec' = "shut"
              /\ UNCHANGED <<owned, closedEvt>>
    /\ UNCHANGED <<stage, factory, closePc, callPc, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>

\* start()'s cancel handler: it waits (shielded) for the factory's thread,
\* shuts down what it built, then fires START_FAILED (and re-raises).
StartCancelled ==
    /\ startPc = "cancelled" /\ factory \in {"built", "failed"}
    /\ startPc' = "done"
    /\ exec' = IF exec = "live" THEN "shut" ELSE exec
    /\ EngineFire("START_FAILED")
    /\ closedEvt' = (closedEvt \/ eng' \in EngineTerminal)
    /\ UNCHANGED <<stage, factory, owned, closePc, callPc, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>

-----------------------------------------------------------------------------
(* close()                                                                 *)

\* CLOSE, then by the state it found: NEW -> CLOSED, nothing to release;
\* STARTING -> CLOSING, wait for the start to give up; RUNNING -> CLOSING,
\* end every request; CLOSING (a second close) waits for the first;
\* CLOSED or FAILED (terminal: no event leaves them): return at once, firing nothing.
CloseCall(c) ==
    /\ closePc[c] = "idle"
    /\ IF eng \in EngineTerminal
          THEN /\ Silent /\ UNCHANGED eng
          ELSE EngineFire("CLOSE")
    /\ closePc' = [closePc EXCEPT ![c] =
          CASE eng = "NEW" -> "returned"
            [] eng = "STARTING" -> "waitstart"
            [] eng = "RUNNING" -> "abortall"
            [] eng = "CLOSING" -> "wait"
            [] OTHER -> "returned"]
    /\ closedEvt' = (closedEvt \/ eng = "NEW")
    /\ UNCHANGED <<stage, startPc, factory, exec, owned, callPc, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>

CloseWaitStart(c) ==
    /\ closePc[c] = "waitstart" /\ startPc = "done"
    /\ closePc' = [closePc EXCEPT ![c] = "abortall"]
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

\* CLOSE on each request whose end is not decided yet, one at a time.
CloseRequest(c, r) ==
    /\ closePc[c] = "abortall" /\ Live(r) /\ ~Ending(r)
    /\ StageFire(r, "CLOSE")
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

\* For trace validation only (not a step of Next): CLOSE on a request whose
\* end was decided already, which changes nothing (the table's self-loop).
CloseRequestAgain(c, r) ==
    /\ closePc[c] = "abortall" /\ Ending(r)
    /\ StageFire(r, "CLOSE")
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

\* Every request's end decided: shut down the executor the engine holds
\* (its workers go: nothing of any request is left there; a send blocked on
\* a full pipe fails).
CloseShutdown(c) ==
    /\ closePc[c] = "abortall" /\ \A r \in Reqs : ~Live(r) \/ Ending(r)
    /\ closePc' = [closePc EXCEPT ![c] = "drain"]
    /\ IF owned
       THEN /\ exec' = "shut"
            /\ wk' = [r \in Reqs |-> IF OnWorker(r) THEN "gone" ELSE wk[r]]
       ELSE UNCHANGED <<exec, wk>>
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, owned, closedEvt, callPc, net, cancelSent, dataQ, ctrlQ, ioBusy>>

\* Every request gone: CLOSED, and the waiting closes are woken.
CloseFinish(c) ==
    /\ closePc[c] = "drain" /\ \A r \in Reqs : ~Live(r)
    /\ EngineFire("CLOSED")
    /\ closedEvt' = TRUE
    /\ closePc' = [closePc EXCEPT ![c] = "returned"]
    /\ UNCHANGED <<stage, startPc, factory, exec, owned, callPc, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>

CloseWait(c) ==
    /\ closePc[c] = "wait" /\ closedEvt
    /\ closePc' = [closePc EXCEPT ![c] = "returned"]
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

-----------------------------------------------------------------------------
(* The caller's requests                                                   *)

\* generate: only while RUNNING (the machine starts in WAITING).
Generate(r) ==
    /\ eng = "RUNNING" /\ stage[r] = "NONE"
    /\ stage' = [stage EXCEPT ![r] = StageInitial]
    /\ Silent
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

\* The scheduler admits a waiting request while RUNNING; its driver queues
\* its data.
Admit(r) ==
    /\ eng = "RUNNING" /\ stage[r] = "WAITING"
    /\ StageFire(r, "ADMIT")
    /\ net' = [net EXCEPT ![r] = "queued"]
    /\ dataQ' = Append(dataQ, [k |-> "data", r |-> r])
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, wk, cancelSent, ctrlQ, ioBusy>>

\* abort(r, wait=True): ABORT (a request already ended: nothing to do).
Abort(r) ==
    /\ callPc[r] = "idle" /\ stage[r] # "NONE"
    /\ IF Live(r)
       THEN StageFire(r, "ABORT") /\ callPc' = [callPc EXCEPT ![r] = "waiting"]
       ELSE Silent /\ callPc' = [callPc EXCEPT ![r] = "returned"] /\ UNCHANGED stage
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>

\* The caller goes away (its generate cancelled, a stream's consumer left).
Leave(r) ==
    /\ callPc[r] = "idle" /\ Live(r)
    /\ StageFire(r, "CANCEL") /\ callPc' = [callPc EXCEPT ![r] = "left"]
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>

AbortReturn(r) ==
    /\ callPc[r] = "waiting" /\ stage[r] \in StageTerminal
    /\ callPc' = [callPc EXCEPT ![r] = "returned"]
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

\* A stream's consumer takes its result.
Consume(r) ==
    /\ stage[r] = "RESOLVED"
    /\ StageFire(r, "GONE")
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

-----------------------------------------------------------------------------
(* The data path (one I/O thread), the control path, the worker            *)

\* The I/O thread sends the request at the head of the data queue; to a shut
\* executor the send fails.  The driver fires SENT (or FAIL).
IoSend ==
    /\ ioBusy = "-" /\ dataQ # <<>> /\ Head(dataQ).k = "data"
    /\ LET r == Head(dataQ).r IN
       IF exec = "shut"
       THEN /\ net' = [net EXCEPT ![r] = "broken"] /\ StageFire(r, "FAIL") /\ UNCHANGED wk
       ELSE /\ net' = [net EXCEPT ![r] = "sent"] /\ wk' = [wk EXCEPT ![r] = "run"] /\ StageFire(r, "SENT")
    /\ dataQ' = Tail(dataQ)
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, cancelSent, ctrlQ, ioBusy>>

\* ... or the send blocks: the worker's pipe is full (for ever, as far as
\* anyone can tell; only the executor's shutdown breaks it).
IoBlock ==
    /\ ioBusy = "-" /\ dataQ # <<>> /\ Head(dataQ).k = "data" /\ Head(dataQ).r \in Blockers
    /\ exec # "shut"
    /\ ioBusy' = Head(dataQ).r
    /\ net' = [net EXCEPT ![Head(dataQ).r] = "stuck"]
    /\ dataQ' = Tail(dataQ)
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, wk, cancelSent, ctrlQ>>

\* A blocked send fails once the executor is shut down.
SendBroken ==
    /\ ioBusy # "-" /\ exec = "shut"
    /\ net' = [net EXCEPT ![ioBusy] = "broken"]
    /\ ioBusy' = "-"
    /\ StageFire(ioBusy, "FAIL")
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, wk, cancelSent, dataQ, ctrlQ>>

\* The worker side takes a cancel: a forward in flight ends, an output is dropped.
CancelArrives(r) == wk' = [wk EXCEPT ![r] = IF OnWorker(r) THEN "gone" ELSE @]

CtrlDeliver ==
    /\ ctrlQ # <<>>
    /\ CancelArrives(Head(ctrlQ))
    /\ ctrlQ' = Tail(ctrlQ)
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, cancelSent, dataQ, ioBusy>>

\* A cancel on the data queue (only the buggy variant E5 puts one there).
IoCancel ==
    /\ ioBusy = "-" /\ dataQ # <<>> /\ Head(dataQ).k = "cancel"
    /\ CancelArrives(Head(dataQ).r)
    /\ dataQ' = Tail(dataQ)
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, cancelSent, ctrlQ, ioBusy>>

\* The forward ends (COMPUTE_DONE) or fails (FAIL; nothing of it is left).
\* Neither is fair: a forward may run until something cancels it.
WorkerCompute(r) ==
    /\ wk[r] = "run" /\ exec = "live"
    /\ \/ wk' = [wk EXCEPT ![r] = "out"] /\ StageFire(r, "COMPUTE_DONE")
       \/ wk' = [wk EXCEPT ![r] = "gone"] /\ StageFire(r, "FAIL")
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, cancelSent, dataQ, ctrlQ, ioBusy>>

\* Its output arrives; the engine takes it from the executor (OUTPUT: on
\* to post-processing, or released when its end was decided).
Deliver(r) ==
    /\ wk[r] = "out"
    /\ wk' = [wk EXCEPT ![r] = "gone"]
    /\ StageFire(r, "OUTPUT")
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, cancelSent, dataQ, ctrlQ, ioBusy>>

\* The host stage's value is the result (a stream: its consumer decides).
Finish(r) ==
    /\ stage[r] = "POSTPROCESSING"
    /\ StageFire(r, IF r \in Streams THEN "STREAM_RESULT" ELSE "RESULT")
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

-----------------------------------------------------------------------------
(* A request's driver once its end is decided: release what it finds      *)

\* Its data not taken by the I/O thread yet: withdrawn from the queue.
DriverWithdraw(r) ==
    /\ Ending(r) /\ net[r] = "queued"
    /\ net' = [net EXCEPT ![r] = "withdrawn"]
    /\ dataQ' = SelectSeq(dataQ, LAMBDA m : m.r # r)
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, wk, cancelSent, ctrlQ, ioBusy>>

\* Sent, and something of it on the worker: a cancel on the CONTROL path.
DriverCancel(r) ==
    /\ Ending(r) /\ net[r] = "sent" /\ OnWorker(r) /\ ~cancelSent[r]
    /\ cancelSent' = [cancelSent EXCEPT ![r] = TRUE]
    /\ ctrlQ' = Append(ctrlQ, r)
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk, dataQ, ioBusy>>

\* Nothing of it left anywhere: GONE, its outcome.
DriverGone(r) ==
    /\ Ending(r) /\ net[r] \notin {"queued", "stuck"} /\ ~OnWorker(r) /\ ~CancelQueued(r)
    /\ StageFire(r, "GONE")
    /\ UNCHANGED <<eng, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent,
                   dataQ, ctrlQ, ioBusy>>

-----------------------------------------------------------------------------
(* Next, with the actions the buggy variants replace as parameters         *)

\* The system's own steps (fair): threads, drivers, close's and start's continuations.
SystemWith(StartDone, StartCancelDone, SendCancel(_)) ==
    \/ FactoryRun \/ StartDone \/ StartCancelDone
    \/ \E c \in Closes : CloseWaitStart(c) \/ CloseShutdown(c) \/ CloseFinish(c) \/ CloseWait(c)
    \/ \E c \in Closes, r \in Reqs : CloseRequest(c, r)
    \/ IoSend \/ SendBroken \/ CtrlDeliver \/ IoCancel
    \/ \E r \in Reqs : Deliver(r) \/ Finish(r) \/ AbortReturn(r)
                       \/ DriverWithdraw(r) \/ SendCancel(r) \/ DriverGone(r)

\* The caller's and the environment's choices (not fair).
Environment ==
    \/ CallStart \/ CancelStart \/ IoBlock
    \/ \E c \in Closes : CloseCall(c)
    \/ \E r \in Reqs : Generate(r) \/ Admit(r) \/ Abort(r) \/ Leave(r) \/ Consume(r) \/ WorkerCompute(r)

NextWith(StartDone, StartCancelDone, SendCancel(_)) ==
    SystemWith(StartDone, StartCancelDone, SendCancel) \/ Environment

System == SystemWith(StartFinish, StartCancelled, DriverCancel)
Next == NextWith(StartFinish, StartCancelled, DriverCancel)

Spec == Init /\ [][Next]_vars

\* Every step changes View (no cycles but stuttering), so weak fairness of
\* the system's steps together is as strong as per thread here.
FairSpec == Spec /\ WF_vars(System)

-----------------------------------------------------------------------------
(* Invariants                                                              *)

\* FAILED or CLOSED: no live executor built by start (defects 1, 3).
FailedHasNoExecutor == eng \in EngineTerminal => exec # "live"

\* After a close(), never RUNNING (defect 2).
ClosedStaysClosed == CloseCalled => eng # "RUNNING"

\* Requests are admitted only by a running engine: none is at work before
\* STARTED or after the last close began.
ServedOnlyRunning == \A r \in Reqs : stage[r] # "NONE" => owned

\* Nothing of a request is on the worker, queued or in flight after its end.
GoneLeavesNothing ==
    \A r \in Reqs : stage[r] \in StageTerminal =>
        /\ ~OnWorker(r) /\ net[r] \notin {"queued", "stuck"} /\ ~Queued(r) /\ ~CancelQueued(r)

\* CLOSED: every request ended, the executor shut down, no send blocked.
ClosedIsIdle ==
    eng = "CLOSED" => /\ \A r \in Reqs : ~Live(r)
                      /\ exec # "live" /\ ioBusy = "-"

\* Exactly one outcome per request: a terminal stage never changes.
OutcomeOnce == [][\A r \in Reqs : stage[r] \in StageTerminal => stage'[r] = stage[r]]_vars

-----------------------------------------------------------------------------
(* Liveness (FairSpec)                                                     *)

CloseReturns == \A c \in Closes : closePc[c] \notin {"idle", "returned"} ~> closePc[c] = "returned"

\* An abort with wait returns, also while a data send blocks for ever (that
\* blocked request's own abort excepted: its data never left).
AbortReturns == \A r \in Reqs \ Blockers : callPc[r] = "waiting" ~> callPc[r] = "returned"

\* A cancelled start ends with the factory's thread done and nothing it
\* built left running.
StartCancelCleans ==
    startPc = "cancelled" ~> (startPc = "done" /\ factory \in {"built", "failed"} /\ exec # "live")

StartReturns == startPc \in {"await", "cancelled"} ~> startPc = "done"

=============================================================================
