---------------------------- MODULE AsyncOutput ----------------------------
(***************************************************************************)
(* The two-phase asynchronous output protocol of omni_async.               *)
(*                                                                         *)
(* Actors:                                                                 *)
(*   - per rank, the worker's main thread: takes the next execute RPC,     *)
(*     runs the forward, hands each output to the packer, then answers     *)
(*     (the reply rank with COMPUTE_DONE naming one id per request, the    *)
(*     other ranks with an empty RPC_RESULT; a failed forward with a       *)
(*     failed RPC_RESULT);                                                 *)
(*   - the reply rank's packer: waits for the forward's event, copies the  *)
(*     output into a leased shared-memory segment, sends OUTPUT_READY      *)
(*     (or OUTPUT_READY carrying a failure);                               *)
(*   - the result channel: one FIFO per rank, in put order.  The main      *)
(*     thread and the packer of a rank put independently, so OUTPUT_READY *)
(*     can overtake its COMPUTE_DONE; the pump reads the ranks' FIFOs in   *)
(*     any interleaving;                                                   *)
(*   - the executor's pump: routes each message to the dispatcher (RPC     *)
(*     answers, F12) and the registry (one record per output id, its      *)
(*     state moved only along the generated RequestTable);                 *)
(*   - the engine: submits RPCs, cancels them, waits for outputs, cancels  *)
(*     or times out its waiters, drops outputs, releases what it consumed, *)
(*     goes away (its consumer is released), shuts down;                   *)
(*   - the monitor: notices a dead worker.                                 *)
(*                                                                         *)
(* Every registry operator below mirrors one method of                     *)
(* omni_async.core.registry.OutputRegistry (see spec/PROTOCOL.md).  The    *)
(* BUG constant switches on one failure mode of the reference              *)
(* implementation (DESIGN.md, F1-F16) so that TLC can show what each one   *)
(* breaks.                                                                 *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, RequestTable

CONSTANTS
    Ranks,          \* the worker ranks, e.g. {0, 1}
    ReplyRank,      \* the rank that announces and ships outputs
    Batch,          \* Batch[k]: the output ids that execute RPC k produces, in request order
    MaxCrashes,     \* how many workers may crash (0 or 1)
    ForwardFails,   \* BOOLEAN: a rank's forward may fail
    PackFails,      \* BOOLEAN: packing may fail
    SendFails,      \* BOOLEAN: the reply rank's put of COMPUTE_DONE may raise
    EngineAborts,   \* BOOLEAN: the engine may cancel, drop, time out and shut down
    MaxQueue,       \* state constraint: messages per rank FIFO
    Bug             \* "none", or the failure mode to reintroduce (see BugModes)

BugModes == {"none", "F3", "F6", "F7", "F9", "F10", "F11", "F12", "F16", "DeathKeepsOpen", "ReclaimShipped",
             "CancelKeepsOutputs", "SendFailKeepsShipped", "PackerCancelsUndropped"}

ASSUME Bug \in BugModes
ASSUME ReplyRank \in Ranks

NumRpcs == Len(Batch)
RpcIds == 1..NumRpcs
Range(s) == {s[n] : n \in DOMAIN s}
Ids == UNION {Range(Batch[k]) : k \in RpcIds}
RpcOf(i) == CHOOSE k \in RpcIds : i \in Range(Batch[k])
NoId == "-"

\* What the engine knows about an output id.
EngineViews == {"none", "known", "waiting", "holding", "done"}
\* The registry's waiter slot: "cancelled" = the Future was cancelled, the
\* done-callback that tells the registry has not run yet.
WaiterSlots == {"none", "waiting", "cancelled"}
SegStates == {"none", "leased", "consumer", "released"}
\* "cancelling": the engine cancelled the call's Future, the dispatcher still
\* waits for its answers; "gone": its consumer went away.
RpcStates == {"idle", "pending", "cancelling", "ok", "failed", "cancelled", "timeout", "shutdown", "gone"}
\* "shipped": a failed answer that names the ids the rank had already handed
\* to its packer (the failure that replaces a COMPUTE_DONE whose put raised).
Answers == {"none", "ok", "failed", "shipped"}

\* ids: the output ids the message names (async_output_ids): a COMPUTE_DONE's,
\* or those of the failure that replaces a COMPUTE_DONE whose put raised.
Msg == [kind : {"COMPUTE_DONE", "OUTPUT_READY", "RPC_RESULT"},
        rpc : 0..NumRpcs, id : Ids \cup {NoId}, ok : BOOLEAN,
        out : Ids \cup {NoId}, w : {"main", "packer"}, ids : SUBSET Ids]

\* Everything about one output id outside the worker.
Rec == [st : RequestStates \cup {"NONE"},     \* registry record ("NONE": no record)
        held : Ids \cup {NoId, "failure"},     \* the payload the record holds (the id of its output)
        waiter : WaiterSlots,
        eng : EngineViews,
        seg : SegStates,                        \* the id's shared-memory segment
        frees : 0..3,                           \* history: how often the segment was released
        nres : 0..3,                            \* history: how often the engine's future was resolved
        got : Ids \cup {NoId},                  \* history: whose output the engine's future got
        dropped : BOOLEAN,                      \* history: the id was dropped
        gaveUp : BOOLEAN,                       \* history: the engine cancelled its waiter, or its deadline passed
        late : SUBSET {"cd", "out"}]            \* tombstone: messages still expected after removal

VARIABLES
    alive,        \* [Ranks -> BOOLEAN]
    mainPc,       \* [Ranks -> {"idle", "sendOk", "sendFail"}]: after a forward, before its answer
    mainRpc,      \* [Ranks -> 0..NumRpcs]: the last RPC the main thread took
    failedRanks,  \* history: [RpcIds -> SUBSET Ranks], ranks whose forward (or COMPUTE_DONE put) failed
    ws,           \* [Ids -> RequestStates]: the worker's machine of each id (reply rank)
    packQ,        \* the packer's queue of ids
    packing,      \* the id the packer is copying, or NoId
    chan,         \* [Ranks -> Seq(Msg)]: the result channel
    sent, recvd,  \* history: messages put / taken per rank
    crashes,      \* workers crashed so far
    pump,         \* the pump's lifecycle state (LifecycleTable)
    closed,       \* the registry is closed (shutdown)
    dead,         \* the executor saw a worker die
    submitted,    \* execute RPCs the engine has submitted, 1..submitted
    rpcs,         \* [RpcIds -> RpcStates]: the dispatcher's view of each RPC
    answers,      \* [RpcIds -> [Ranks -> Answers]]
    rec,          \* [Ids -> Rec]
    perr,         \* history: the registry refused a message (a protocol error)
    gone          \* the engine's consumer went away (release_consumer)

worker == <<alive, mainPc, mainRpc, failedRanks, ws, packQ, packing, crashes>>
channel == <<chan, sent, recvd>>
executor == <<pump, closed, dead, submitted, rpcs, answers, rec, perr, gone>>
vars == <<worker, channel, executor>>

-----------------------------------------------------------------------------
TypeOK ==
    /\ alive \in [Ranks -> BOOLEAN]
    /\ mainPc \in [Ranks -> {"idle", "sendOk", "sendFail"}]
    /\ mainRpc \in [Ranks -> 0..NumRpcs]
    /\ failedRanks \in [RpcIds -> SUBSET Ranks]
    /\ ws \in [Ids -> RequestStates]
    /\ packQ \in Seq(Ids)
    /\ packing \in Ids \cup {NoId}
    /\ chan \in [Ranks -> Seq(Msg)]
    /\ sent \in [Ranks -> Nat] /\ recvd \in [Ranks -> Nat]
    /\ crashes \in 0..MaxCrashes
    /\ pump \in LifecycleStates
    /\ closed \in BOOLEAN /\ dead \in BOOLEAN
    /\ submitted \in 0..NumRpcs
    /\ rpcs \in [RpcIds -> RpcStates]
    /\ answers \in [RpcIds -> [Ranks -> Answers]]
    /\ rec \in [Ids -> Rec]
    /\ perr \in BOOLEAN
    /\ gone \in BOOLEAN

NoRec == [st |-> "NONE", held |-> NoId, waiter |-> "none", eng |-> "none", seg |-> "none",
          frees |-> 0, nres |-> 0, got |-> NoId, dropped |-> FALSE, gaveUp |-> FALSE, late |-> {}]

Init ==
    /\ alive = [r \in Ranks |-> TRUE]
    /\ mainPc = [r \in Ranks |-> "idle"]
    /\ mainRpc = [r \in Ranks |-> 0]
    /\ failedRanks = [k \in RpcIds |-> {}]
    /\ ws = [i \in Ids |-> RequestInitial]
    /\ packQ = <<>>
    /\ packing = NoId
    /\ chan = [r \in Ranks |-> <<>>]
    /\ sent = [r \in Ranks |-> 0] /\ recvd = [r \in Ranks |-> 0]
    /\ crashes = 0
    /\ pump = LifecycleNext(LifecycleInitial, "STARTED")
    /\ closed = FALSE /\ dead = FALSE
    /\ submitted = 0
    /\ rpcs = [k \in RpcIds |-> "idle"]
    /\ answers = [k \in RpcIds |-> [r \in Ranks |-> "none"]]
    /\ rec = [i \in Ids |-> NoRec]
    /\ perr = FALSE
    /\ gone = FALSE

-----------------------------------------------------------------------------
(* Registry operators: pure functions on one id's Rec, one per step of     *)
(* OutputRegistry.  RequestNext is only defined on the table's pairs, so   *)
(* an illegal event is an evaluation error in TLC, as it is an            *)
(* AssertionError in OutputRegistry._fire.                                 *)

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

Remove(x) == IF x.st \in RequestTerminal THEN [x EXCEPT !.st = "NONE"] ELSE x

\* _after_change: deliver if a waiter and a result meet; remove a terminal record.
AfterChange(x) ==
    Remove(CASE x.waiter = "waiting" /\ x.st \in {"READY", "FAILED"} -> Deliver(x)
             [] ClaimFails(x) -> Discard(RFire([x EXCEPT !.waiter = "none"], "ABANDON"))
             [] OTHER -> x)

\* _abandon.  F9: the reference only forgot the waiter, so an output that
\* arrived later was cached for nobody.
Abandon(x) ==
    IF Bug = "F9" /\ x.st \notin RequestHolding THEN x
    ELSE AfterChange(Discard(RFire(x, "ABANDON")))

\* drop.  F10: the reference removed the waiter but kept the cached output.
Drop(x) ==
    IF x.st = "NONE" THEN x
    ELSE LET y == [FailWaiter(x) EXCEPT !.dropped = TRUE] IN
         IF Bug = "F10" /\ y.st \in RequestHolding THEN y
         ELSE AfterChange(Discard(RFire(y, "DROP")))

Create(x) == IF x.st = "NONE" THEN [x EXCEPT !.st = RegistryInitial] ELSE x

\* on_compute_done for one id.  A duplicate is a protocol error.
\* A message the tombstone of a finished id expects is swallowed (only after
\* a force-release without closing: everywhere else an id ends only once
\* both of its messages have arrived).
CdLate(x) == x.st = "NONE" /\ "cd" \in x.late
CdRefused(x) == ~CdLate(x) /\ Create(x).st \notin RequestAwaitingComputeDone
OnComputeDone(x) ==
    IF CdLate(x) THEN [x EXCEPT !.late = @ \ {"cd"}]
    ELSE IF CdRefused(x) THEN x ELSE AfterChange(RFire(Create(x), "COMPUTE_DONE"))

\* on_output, before _after_change.
OutEvent(ok) == IF ok THEN "OUTPUT_READY" ELSE "OUTPUT_FAILED"
OutLate(x) == x.st = "NONE" /\ "out" \in x.late
OutRefused(x, ok) == ~OutLate(x) /\ ~RequestCan(Create(x).st, OutEvent(ok))
Arrive(x, ok, out) ==
    LET y == RFire(Create(x), OutEvent(ok)) IN
    IF y.st \in RequestHolding THEN [y EXCEPT !.held = IF ok THEN out ELSE "failure"]
    ELSE IF ok THEN ReleaseSeg(y)          \* nobody wants it: released on arrival (F9, F10)
    ELSE y
OnOutput(x, ok, out) ==
    IF OutLate(x) THEN (IF ok THEN ReleaseSeg([x EXCEPT !.late = @ \ {"out"}]) ELSE [x EXCEPT !.late = @ \ {"out"}])
    ELSE IF OutRefused(x, ok) THEN (IF ok THEN ReleaseSeg(x) ELSE x)
    ELSE AfterChange(Arrive(x, ok, out))

\* fail_all: every waiter fails, every record is force-released.  F16: the
\* reference failed the waiters but kept the cached outputs.
ForceRelease(x) ==
    IF x.st = "NONE" THEN x
    ELSE IF Bug = "DeathKeepsOpen"
    THEN [AfterChange(Discard(RFire(FailWaiter(x), "FORCE_RELEASE"))) EXCEPT
            !.late = (IF x.st \in RequestAwaitingComputeDone THEN {"cd"} ELSE {})
                     \cup (IF x.st \in {"COMPUTE_DONE", "DROPPING", "RELEASING"} THEN {"out"} ELSE {})]
    ELSE IF Bug = "F16" THEN FailWaiter(x)
    ELSE AfterChange(Discard(RFire(FailWaiter(x), "FORCE_RELEASE")))

\* expire, for a record still waiting for its COMPUTE_DONE (an early
\* OUTPUT_READY created it): force-released, its tombstone expects the
\* COMPUTE_DONE (OutputRegistry._orphan).
ExpireEarly(x) == [AfterChange(Discard(RFire(FailWaiter(x), "FORCE_RELEASE"))) EXCEPT !.late = {"cd"}]

-----------------------------------------------------------------------------
(* Channel helpers. *)

\* put: atomic under the channel's lock.  F7: two threads wrote a
\* single-writer queue; both took the same tail slot and the later store
\* overwrote the other thread's message.
Send(r, m) ==
    /\ sent' = [sent EXCEPT ![r] = @ + 1]
    /\ \/ chan' = [chan EXCEPT ![r] = Append(@, m)]
       \/ /\ Bug = "F7"
          /\ chan[r] # <<>>
          /\ chan[r][Len(chan[r])].w # m.w
          /\ chan' = [chan EXCEPT ![r] = Append(SubSeq(@, 1, Len(@) - 1), m)]

Recv(r) ==
    /\ chan' = [chan EXCEPT ![r] = Tail(@)]
    /\ recvd' = [recvd EXCEPT ![r] = @ + 1]

MsgsOf(r) == {chan[r][n] : n \in 1..Len(chan[r])}

-----------------------------------------------------------------------------
(* Worker actions: omni_async.worker.loop.WorkerLoop.handle_rpc and       *)
(* omni_async.worker.packer.Packer._pack_one.                             *)

\* Take the next execute RPC and run the forward.  The reply rank's machines
\* go QUEUED -> COMPUTING -> COMPUTE_DONE and its outputs go to the packer
\* before COMPUTE_DONE is sent, so the packer can answer first.
WorkerMainForward(r) ==
    /\ alive[r] /\ mainPc[r] = "idle" /\ mainRpc[r] < submitted
    /\ LET k == mainRpc[r] + 1
           ids == Range(Batch[k])
       IN /\ mainRpc' = [mainRpc EXCEPT ![r] = k]
          /\ \/ /\ mainPc' = [mainPc EXCEPT ![r] = "sendOk"]
                /\ IF r = ReplyRank
                   THEN /\ ws' = [i \in Ids |-> IF i \in ids
                                      THEN RequestNext(RequestNext(ws[i], "FORWARD"), "COMPUTE_DONE")
                                      ELSE ws[i]]
                        /\ packQ' = packQ \o Batch[k]
                   ELSE UNCHANGED <<ws, packQ>>
                /\ UNCHANGED failedRanks
             \/ /\ ForwardFails
                /\ mainPc' = [mainPc EXCEPT ![r] = "sendFail"]
                /\ failedRanks' = [failedRanks EXCEPT ![k] = @ \cup {r}]
                /\ IF r = ReplyRank
                   THEN ws' = [i \in Ids |-> IF i \in ids
                                   THEN RequestNext(RequestNext(ws[i], "FORWARD"), "FORCE_RELEASE")
                                   ELSE ws[i]]
                   ELSE UNCHANGED ws
                /\ UNCHANGED packQ
    /\ UNCHANGED <<alive, packing, crashes, channel, executor>>

WorkerMainSendComputeDone(r) ==
    /\ alive[r] /\ r = ReplyRank /\ mainPc[r] = "sendOk"
    /\ Send(r, [kind |-> "COMPUTE_DONE", rpc |-> mainRpc[r], id |-> NoId, ok |-> TRUE,
                out |-> NoId, w |-> "main", ids |-> Range(Batch[mainRpc[r]])])
    /\ mainPc' = [mainPc EXCEPT ![r] = "idle"]
    /\ UNCHANGED <<alive, mainRpc, failedRanks, ws, packQ, packing, crashes, recvd, executor>>

\* The put of COMPUTE_DONE raises (unpicklable, oversize, a full channel) after
\* the outputs went to the packer, whose OUTPUT_READY will come all the same.
\* WorkerLoop._execute_async answers the call with a failure instead, naming
\* the ids it handed to the packer, so that the dispatcher registers and drops
\* them like a failed call's announced ids (Dispatcher.handle).  The failure
\* takes the COMPUTE_DONE's place in the rank's FIFO: every order the registry
\* sees is one it already handles.  SendFailKeepsShipped: the failure names
\* nothing (the reference's WorkerLoop._send fallback), so an output that
\* arrives is held for nobody.
WorkerMainComputeDoneFails(r) ==
    /\ SendFails /\ alive[r] /\ r = ReplyRank /\ mainPc[r] = "sendOk"
    /\ failedRanks' = [failedRanks EXCEPT ![mainRpc[r]] = @ \cup {r}]
    /\ Send(r, [kind |-> "RPC_RESULT", rpc |-> mainRpc[r], id |-> NoId, ok |-> FALSE,
                out |-> NoId, w |-> "main",
                ids |-> IF Bug = "SendFailKeepsShipped" THEN {} ELSE Range(Batch[mainRpc[r]])])
    /\ mainPc' = [mainPc EXCEPT ![r] = "idle"]
    /\ UNCHANGED <<alive, mainRpc, ws, packQ, packing, crashes, recvd, executor>>

WorkerMainSendRpcResult(r) ==
    /\ alive[r]
    /\ \/ mainPc[r] = "sendFail"
       \/ mainPc[r] = "sendOk" /\ r # ReplyRank
    /\ Send(r, [kind |-> "RPC_RESULT", rpc |-> mainRpc[r], id |-> NoId, ok |-> mainPc[r] = "sendOk",
                out |-> NoId, w |-> "main", ids |-> {}])
    /\ mainPc' = [mainPc EXCEPT ![r] = "idle"]
    /\ UNCHANGED <<alive, mainRpc, failedRanks, ws, packQ, packing, crashes, recvd, executor>>

\* The side stream waits for the forward's event, then copies into a leased segment.
PackerPackOutput ==
    /\ alive[ReplyRank] /\ packing = NoId /\ packQ # <<>>
    /\ LET i == Head(packQ) IN
       /\ RequestCan(ws[i], "PACK")
       /\ ws' = [ws EXCEPT ![i] = RequestNext(@, "PACK")]
       /\ rec' = [rec EXCEPT ![i].seg = "leased"]
       /\ packing' = i
       /\ packQ' = Tail(packQ)
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, crashes, channel, pump, closed, dead,
                   submitted, rpcs, answers, perr, gone>>

PackerSendOutputReady ==
    /\ alive[ReplyRank] /\ packing # NoId
    /\ ws' = [ws EXCEPT ![packing] = RequestNext(@, "OUTPUT_READY")]
    /\ Send(ReplyRank, [kind |-> "OUTPUT_READY", rpc |-> 0, id |-> packing, ok |-> TRUE,
                        out |-> packing, w |-> "packer", ids |-> {}])
    /\ packing' = NoId
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packQ, crashes, recvd, executor>>

\* Packing failed: the segment goes back, the failure travels typed (F2).
PackerSendOutputFailed ==
    /\ PackFails
    /\ alive[ReplyRank] /\ packing # NoId
    /\ ws' = [ws EXCEPT ![packing] = RequestNext(@, "OUTPUT_FAILED")]
    /\ rec' = [rec EXCEPT ![packing] = ReleaseSeg(@)]
    /\ Send(ReplyRank, [kind |-> "OUTPUT_READY", rpc |-> 0, id |-> packing, ok |-> FALSE,
                        out |-> NoId, w |-> "packer", ids |-> {}])
    /\ packing' = NoId
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packQ, crashes, recvd,
                   pump, closed, dead, submitted, rpcs, answers, perr, gone>>

\* F15: the engine dropped the output before packing started; the drop reached
\* the packer (Packer.drop), which sends a "Cancelled" failure instead.
\* PackerCancelsUndropped: the guard is gone, the packer cancels an output
\* that nobody dropped (NoSpuriousFailure).
PackerCancelOutput ==
    /\ alive[ReplyRank] /\ packing = NoId /\ packQ # <<>>
    /\ LET i == Head(packQ) IN
       /\ Bug = "PackerCancelsUndropped" \/ (rec[i].dropped /\ rec[i].eng = "done")
       /\ ws' = [ws EXCEPT ![i] = RequestNext(RequestNext(@, "DROP"), "OUTPUT_FAILED")]
       /\ Send(ReplyRank, [kind |-> "OUTPUT_READY", rpc |-> 0, id |-> i, ok |-> FALSE,
                           out |-> NoId, w |-> "packer", ids |-> {}])
       /\ packQ' = Tail(packQ)
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packing, crashes, recvd, executor>>

WorkerCrash(r) ==
    /\ crashes < MaxCrashes /\ alive[r] /\ ~closed
    /\ alive' = [alive EXCEPT ![r] = FALSE]
    /\ crashes' = crashes + 1
    /\ UNCHANGED <<mainPc, mainRpc, failedRanks, ws, packQ, packing, channel, executor>>

-----------------------------------------------------------------------------
(* Pump actions: omni_async.executor.pump.ResultPump._step ->             *)
(* omni_async.core.dispatch.Dispatcher.handle.                            *)

\* The ids the reply rank announced for RPC k (its COMPUTE_DONE, or the failure
\* naming what it shipped, was received).
Announced(k) == IF answers[k][ReplyRank] \in {"ok", "shipped"} THEN Range(Batch[k]) ELSE {}

\* The dispatcher still waits for RPC k's answers (its Future may be cancelled).
Pending(k) == rpcs[k] \in {"pending", "cancelling"}

\* Dispatcher._answer / _complete.  F12: the reference resolved the call on
\* the reply rank's answer, before the other ranks had answered.
Complete(k, ans, r) ==
    IF Bug = "F12" THEN r = ReplyRank ELSE \A q \in Ranks : ans[q] # "none"

\* Record rank r's answer to RPC k (ok; a failure; a failure naming ids);
\* resolve the RPC once complete: the engine learns the announced ids, or
\* (any failure, or the engine cancelled the call) they are dropped.  x: rec
\* after the registry part of the step.
Dispatch(k, r, ok, named, ids, x) ==
    LET pend == Pending(k)
        ans == [answers[k] EXCEPT ![r] = IF ok THEN "ok" ELSE IF named THEN "shipped" ELSE "failed"]
        done == pend /\ Complete(k, ans, r)
        fail == \E q \in Ranks : ans[q] \in {"failed", "shipped"}
        cancelled == rpcs[k] = "cancelling"
        \* CancelKeepsOutputs: the claim of the cancelled Future fails, the ids stay.
        lose == ~pend \/ (done /\ fail) \/ (done /\ cancelled /\ Bug # "CancelKeepsOutputs")
    IN /\ answers' = IF pend THEN [answers EXCEPT ![k] = ans] ELSE answers
       /\ rpcs' = IF done
                  THEN [rpcs EXCEPT ![k] = IF fail THEN "failed" ELSE IF cancelled THEN "cancelled" ELSE "ok"]
                  ELSE rpcs
       /\ rec' = [i \in Ids |->
                    IF i \notin ids THEN x[i]
                    ELSE IF lose THEN Drop(x[i])
                    ELSE IF done /\ ~cancelled THEN [x[i] EXCEPT !.eng = "known"]
                    ELSE x[i]]

\* A message that names output ids: a COMPUTE_DONE, or the failure that
\* replaces one (Dispatcher.handle registers its ids the same way).
Names(m) == m.ids # {}

PumpRecvComputeDone(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Names(Head(chan[r]))
    /\ LET m == Head(chan[r])
           ids == m.ids
       IN /\ Dispatch(m.rpc, r, m.ok, TRUE, ids, [i \in Ids |-> IF i \in ids THEN OnComputeDone(rec[i]) ELSE rec[i]])
          /\ perr' = (perr \/ \E i \in ids : CdRefused(rec[i]))
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, pump, closed, dead, submitted, gone>>

PumpRecvRpcResult(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Head(chan[r]).kind = "RPC_RESULT" /\ ~Names(Head(chan[r]))
    /\ LET m == Head(chan[r]) IN
       \* A late answer (the RPC already ended) goes to the synchronous buffer,
       \* unread; it drops nothing (the call's end already disposed of its ids).
       Dispatch(m.rpc, r, m.ok, FALSE, IF Pending(m.rpc) THEN Announced(m.rpc) ELSE {}, rec)
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, pump, closed, dead, submitted, perr, gone>>

\* F6: the reference split a batch output by a map registered at COMPUTE_DONE;
\* an output that arrived first found no map and was thrown away.
\* F3: a waiter cancelled between "is it done?" and "set result" raised inside
\* the pump and killed it.
PumpRecvOutputReady(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Head(chan[r]).kind = "OUTPUT_READY"
    /\ LET m == Head(chan[r])
           x == rec[m.id]
       IN CASE Bug = "F6" /\ x.st = "NONE" ->
                 UNCHANGED <<pump, rec, perr, gone>>
            [] Bug = "F3" /\ ~OutRefused(x, m.ok) /\ ClaimFails(Arrive(x, m.ok, m.out)) ->
                 /\ pump' = LifecycleNext(pump, "CRASH")
                 /\ rec' = [rec EXCEPT ![m.id] = Arrive(x, m.ok, m.out)]
                 /\ UNCHANGED perr
            [] OTHER ->
                 /\ rec' = [rec EXCEPT ![m.id] = OnOutput(x, m.ok, m.out)]
                 /\ perr' = (perr \/ OutRefused(x, m.ok))
                 /\ UNCHANGED pump
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, closed, dead, submitted, rpcs, answers, gone>>

\* Dispatcher.expire: the compute deadline of a pending RPC passed.
PumpExpireRpc(k) ==
    /\ EngineAborts /\ pump = "RUNNING" /\ Pending(k)
    /\ rpcs' = [rpcs EXCEPT ![k] = "timeout"]
    /\ rec' = [i \in Ids |-> IF i \in Announced(k) THEN Drop(rec[i]) ELSE rec[i]]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, answers, perr, gone>>

\* OutputRegistry.expire: the output deadline (armed at COMPUTE_DONE) passed:
\* the record is abandoned.  Or the deadline of a record that an early
\* OUTPUT_READY created passed (armed at its arrival, no earlier than the
\* compute deadline of every call pending then, so its call has ended): its
\* COMPUTE_DONE is given up on, the record force-released (its tombstone
\* swallows a COMPUTE_DONE still to come), counted as orphaned.
PumpExpireOutput(i) ==
    /\ EngineAborts /\ pump = "RUNNING"
    /\ \/ /\ rec[i].st \in {"COMPUTE_DONE", "READY", "FAILED"}
          /\ rec' = [rec EXCEPT ![i] = [Abandon(FailWaiter(@)) EXCEPT !.gaveUp = TRUE]]
       \/ /\ rec[i].st \in RequestAwaitingComputeDone /\ ~Pending(RpcOf(i))
          /\ rec' = [rec EXCEPT ![i] = [ExpireEarly(@) EXCEPT !.gaveUp = TRUE]]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone>>

-----------------------------------------------------------------------------
(* Engine actions: omni_async.executor.api.DiffusionExecutor.             *)

\* (the model's one consumer submits nothing once it went away)
EngineSubmitRpc ==
    /\ ~closed /\ ~dead /\ ~gone /\ pump = "RUNNING" /\ \A r \in Ranks : alive[r]
    /\ submitted < NumRpcs
    /\ submitted' = submitted + 1
    /\ rpcs' = [rpcs EXCEPT ![submitted + 1] = "pending"]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, answers, rec, perr, gone>>

\* The engine cancels the Future of an execute call before it resolves: the
\* dispatcher keeps waiting for the answers, then drops what the call
\* announced (Dispatcher._complete: the claim of the cancelled Future fails).
EngineCancelRpc(k) ==
    /\ EngineAborts /\ rpcs[k] = "pending"
    /\ rpcs' = [rpcs EXCEPT ![k] = "cancelling"]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, answers, rec, perr, gone>>

\* The consumer goes away without aborting (F11), Dispatcher.release_consumer:
\* it will claim none of the ids it learned; its pending calls fail ("consumer
\* gone"; what they announce later is an orphan, dropped on arrival) and every
\* record it owns is abandoned: those whose COMPUTE_DONE arrived while their
\* call was pending (a record in another state has no consumer yet, or ABANDON
\* changes nothing there).  F11: the reference kept them cached.
EngineReleaseConsumer ==
    /\ EngineAborts /\ ~closed /\ ~gone
    /\ gone' = TRUE
    /\ rpcs' = [k \in RpcIds |-> IF Pending(k) THEN "gone" ELSE rpcs[k]]
    /\ rec' = [i \in Ids |->
                 LET y == IF Bug # "F11" /\ rec[i].st \in {"COMPUTE_DONE", "PACKING", "READY", "FAILED"}
                          THEN Abandon(FailWaiter(rec[i])) ELSE rec[i]
                 IN [y EXCEPT !.eng = IF @ = "known" THEN "done" ELSE @]]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, answers, perr>>

\* wait_output_ready: an id that is gone or unwanted fails at once.
EngineWaitOutput(i) ==
    /\ ~closed /\ rec[i].eng = "known"
    /\ rec' = [rec EXCEPT ![i] =
                 IF @.st \in {"NONE", "DROPPING", "DROPPING_EARLY", "RELEASING", "RELEASING_EARLY"}
                 THEN [@ EXCEPT !.eng = "done", !.nres = @ + 1]
                 ELSE AfterChange([@ EXCEPT !.waiter = "waiting", !.eng = "waiting"])]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone>>

\* The engine cancels its Future; the registry hears of it in the done-callback.
EngineCancelWait(i) ==
    /\ EngineAborts /\ rec[i].waiter = "waiting"
    /\ rec' = [rec EXCEPT ![i].waiter = "cancelled", ![i].eng = "done", ![i].nres = @ + 1, ![i].gaveUp = TRUE]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone>>

\* The done-callback of a cancelled Future: OutputRegistry.cancel.
RegistryCancelWaiter(i) ==
    /\ rec[i].waiter = "cancelled"
    /\ rec' = [rec EXCEPT ![i] = Abandon([@ EXCEPT !.waiter = "none"])]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone>>

\* drop_output (abort), valid in every state (F10).
EngineDropOutput(i) ==
    /\ EngineAborts /\ ~closed /\ rec[i].eng \in {"known", "waiting"}
    /\ rec' = [rec EXCEPT ![i] = [Drop(@) EXCEPT !.eng = "done", !.dropped = TRUE]]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone>>

\* The consumer is done with a delivered output and gives its segment back.
EngineReleaseOutput(i) ==
    /\ rec[i].eng = "holding"
    /\ rec' = [rec EXCEPT ![i] = [(IF @.seg = "consumer" THEN ReleaseSeg(@) ELSE @) EXCEPT !.eng = "done"]]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone>>

\* Close the registry (fail every waiter and RPC, release every record), stop
\* the workers; the pool unlinks every segment still leased (in a packer or
\* in an unread message).  The shared part of shutdown and of a worker's death.
\* reclaim: ReclaimShipped, see MonitorDetectDeath.
CloseAll(reclaim) ==
    /\ closed' = TRUE
    /\ pump' = IF LifecycleCan(pump, "DRAIN") THEN LifecycleNext(LifecycleNext(pump, "DRAIN"), "STOPPED") ELSE pump
    /\ rpcs' = [k \in RpcIds |-> IF Pending(k) THEN "shutdown" ELSE rpcs[k]]
    /\ rec' = [i \in Ids |->
                 LET r0 == IF reclaim /\ rec[i].seg \in {"leased", "consumer"} THEN ReleaseSeg(rec[i]) ELSE rec[i]
                     y == ForceRelease(r0)
                     z == IF y.seg = "leased" THEN ReleaseSeg(y) ELSE y
                 IN [z EXCEPT !.eng = IF @ = "known" THEN "done" ELSE @]]
    /\ alive' = [r \in Ranks |-> FALSE]
    /\ chan' = [r \in Ranks |-> <<>>]
    /\ recvd' = sent
    /\ packQ' = <<>>
    /\ packing' = NoId

EngineShutdown ==
    /\ EngineAborts /\ ~closed
    /\ CloseAll(FALSE)
    /\ UNCHANGED <<mainPc, mainRpc, failedRanks, ws, crashes, sent, dead, submitted, answers, perr, gone>>

\* The monitor sees a dead worker.  We shut the executor down (nothing can
\* complete any more).  DeathKeepsOpen: ResultPump.fail_all without closing:
\* every record is force-released (leaving a tombstone that swallows its late
\* messages, as OutputRegistry._finished does) but the pump keeps reading.
MonitorDetectDeath ==
    /\ ~dead /\ ~closed /\ \E r \in Ranks : ~alive[r]
    /\ dead' = TRUE
    /\ IF Bug = "DeathKeepsOpen"
       THEN /\ rpcs' = [k \in RpcIds |-> IF Pending(k) THEN "shutdown" ELSE rpcs[k]]
            /\ rec' = [i \in Ids |->
                         LET y == ForceRelease(rec[i])
                             z == IF packing = i /\ ~alive[ReplyRank] THEN ReleaseSeg(y) ELSE y
                         IN [z EXCEPT !.eng = IF @ = "known" THEN "done" ELSE @]]
            /\ packing' = IF alive[ReplyRank] THEN packing ELSE NoId
            /\ UNCHANGED <<alive, chan, recvd, packQ, closed, pump>>
       \* ReclaimShipped: a reclaim_owner(pid) that also freed the leases the dead
       \* process had shipped (the implementation hands each lease off before the
       \* message is sent, so reclaim spares it) before fail_all discards what the
       \* registry holds.
       ELSE CloseAll(Bug = "ReclaimShipped" /\ ~alive[ReplyRank])
    /\ UNCHANGED <<mainPc, mainRpc, failedRanks, ws, crashes, sent, submitted, answers, perr, gone>>

-----------------------------------------------------------------------------
PumpRecv(r) == PumpRecvComputeDone(r) \/ PumpRecvRpcResult(r) \/ PumpRecvOutputReady(r)

Next ==
    \/ EngineSubmitRpc
    \/ EngineShutdown
    \/ MonitorDetectDeath
    \/ PackerPackOutput
    \/ PackerSendOutputReady
    \/ PackerSendOutputFailed
    \/ PackerCancelOutput
    \/ \E r \in Ranks :
          \/ WorkerMainForward(r)
          \/ WorkerMainSendComputeDone(r)
          \/ WorkerMainComputeDoneFails(r)
          \/ WorkerMainSendRpcResult(r)
          \/ WorkerCrash(r)
          \/ PumpRecv(r)
    \/ EngineReleaseConsumer
    \/ \E k \in RpcIds : PumpExpireRpc(k) \/ EngineCancelRpc(k)
    \/ \E i \in Ids :
          \/ EngineWaitOutput(i)
          \/ EngineCancelWait(i)
          \/ RegistryCancelWaiter(i)
          \/ EngineDropOutput(i)
          \/ EngineReleaseOutput(i)
          \/ PumpExpireOutput(i)

Spec == Init /\ [][Next]_vars

\* The steps of the system's own threads.  The engine's choices (cancel, drop,
\* timeouts, shutdown), failures and crashes are not among them; waiting for
\* an output it learned of and releasing what it consumed are: the engine is
\* assumed to do both.
SystemNext ==
    \/ \E r \in Ranks :
          \/ WorkerMainForward(r)
          \/ WorkerMainSendComputeDone(r)
          \/ WorkerMainSendRpcResult(r)
          \/ PumpRecv(r)
    \/ PackerPackOutput
    \/ PackerSendOutputReady
    \/ PackerSendOutputFailed
    \/ MonitorDetectDeath
    \/ \E i \in Ids :
          \/ RegistryCancelWaiter(i)
          \/ EngineWaitOutput(i)
          \/ EngineReleaseOutput(i)

\* Weak fairness of SystemNext as a whole.  Every step makes progress (the
\* state graph has no cycles but stuttering), so a behaviour stops only where
\* no system step is enabled: as strong here as fairness per thread, and much
\* cheaper for TLC to check.
Fairness == WF_vars(SystemNext)

FairSpec == Spec /\ Fairness

StateConstraint == \A r \in Ranks : Len(chan[r]) <= MaxQueue

-----------------------------------------------------------------------------
(* Invariants. *)

\* The channel never loses a message (F5, F7).
ChannelLossless == \A r \in Ranks : sent[r] = recvd[r] + Len(chan[r])

\* A leased segment always has an owner: the packer, an unread OUTPUT_READY,
\* or a registry record; one the consumer holds was delivered to it.
NoSegmentLeak ==
    \A i \in Ids :
        /\ rec[i].seg = "leased" =>
              \/ packing = i
              \/ \E r \in Ranks : \E m \in MsgsOf(r) : m.kind = "OUTPUT_READY" /\ m.out = i
              \/ \E j \in Ids : rec[j].held = i
        /\ rec[i].seg = "consumer" => rec[i].eng \in {"holding", "done"}

SegmentReleasedOnce == \A i \in Ids : rec[i].frees <= 1

WaiterResolvedOnce == \A i \in Ids : rec[i].nres <= 1

WaiterGetsOwnOutput == \A i \in Ids : rec[i].got \in {NoId, i}

\* Nothing is delivered after a drop.
NoDeliveryAfterDrop == \A i \in Ids : rec[i].dropped => rec[i].eng # "holding" /\ rec[i].got = NoId

\* After a drop only a record waiting to swallow the outstanding message survives.
DropLeavesNothing ==
    \A i \in Ids : rec[i].dropped => rec[i].st \in {"NONE", "DROPPING", "DROPPING_EARLY"}

\* An RPC with a failed rank never resolves as success (F12).
RpcFailureNeverSuccess == \A k \in RpcIds : rpcs[k] = "ok" => failedRanks[k] = {}

\* A COMPUTE_DONE naming i (or the failure that replaces it) is still to come.
CdToCome(i) ==
    LET k == RpcOf(i) IN
    \/ \E m \in MsgsOf(ReplyRank) : i \in m.ids
    \/ alive[ReplyRank] /\ (mainRpc[ReplyRank] < k \/ (mainRpc[ReplyRank] = k /\ mainPc[ReplyRank] = "sendOk"))

\* Somebody may still claim the output of i (or a pending step will release it).
Claimable(i) ==
    \/ rec[i].eng \in {"known", "waiting"}
    \/ rec[i].waiter = "cancelled"
    \/ Pending(RpcOf(i))
    \/ CdToCome(i)
    \/ ~dead /\ \E r \in Ranks : ~alive[r]

\* A held payload always has somebody who may still claim it (F9, F10, F11).
NoOrphanPayload == \A i \in Ids : rec[i].st \in RequestHolding => Claimable(i)

\* Nothing is in flight: no message, no work in a live worker, no pending
\* RPC, no claim by the engine, no dead worker the monitor has not seen.
Idle ==
    /\ \A r \in Ranks : chan[r] = <<>>
    /\ \A r \in Ranks : alive[r] => mainPc[r] = "idle" /\ mainRpc[r] = submitted
    /\ alive[ReplyRank] => packQ = <<>> /\ packing = NoId
    /\ \A k \in RpcIds : ~Pending(k)
    /\ \A i \in Ids : rec[i].eng \in {"none", "done"} /\ rec[i].waiter = "none"
    /\ \A r \in Ranks : ~alive[r] => dead \/ closed

\* The registry and the segment pool are empty whenever nothing is in flight.
QuiescentClean ==
    Idle => \A i \in Ids : rec[i].st = "NONE" /\ rec[i].seg \in {"none", "released"}

\* Something excuses a failure of i, for good: a rank's forward or answer
\* failed, its packing failed, a worker crashed, the engine cancelled the call
\* or dropped the output, the call timed out, the consumer went away, shutdown.
ExcusedOtherwise(i) ==
    LET k == RpcOf(i) IN
    \/ failedRanks[k] # {} \/ rpcs[k] \in {"cancelling", "cancelled", "timeout"}
    \/ ws[i] = "FAILED" \/ rec[i].dropped \/ crashes > 0 \/ closed \/ gone

\* Nothing touched i: its call was submitted, nothing above excuses a failure,
\* and the engine did not give up on it (cancel its waiter; its deadline).
Untouched(i) == RpcOf(i) <= submitted /\ ~ExcusedOtherwise(i) /\ ~rec[i].gaveUp

\* A request that nothing touched gets its own output, as a success: checked
\* at quiescence, in every state of every safety model.  A safety property
\* rather than a liveness one: the liveness models already show that every
\* request settles (RequestsTerminate, WaitersResolve, RpcsResolve), so "it
\* settled, and with its own output" is this invariant; checked in the safety
\* models it covers their larger configurations (batches, pipelining, every
\* failure) at the cost of one history flag (gaveUp, which View keeps from
\* splitting states), where a liveness property would need fairness, no
\* state constraint, and the same history.
\* Without it a spurious failure (the packer cancelling an output nobody
\* dropped: PackerCancelsUndropped) passed every model.
NoSpuriousFailure == Idle => \A i \in Ids : Untouched(i) => rec[i].got = i

\* The registry never refuses a message of a correct worker.
NoProtocolError == ~perr

\* What TLC fingerprints a state by (every model's VIEW): the state, except
\* that gaveUp is forgotten once something else excuses the id.  gaveUp is
\* history that only NoSpuriousFailure reads, through Untouched; every other
\* excuse in Untouched is permanent, so two states that differ only there have
\* the same futures and the same verdicts.  Without it, a deadline or a cancel
\* on an output that a later drop, timeout or shutdown would have excused
\* anyway splits the state space for nothing (half again as many states).
View == <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone,
          [i \in Ids |-> IF ExcusedOtherwise(i) THEN [rec[i] EXCEPT !.gaveUp = FALSE] ELSE rec[i]]>>

-----------------------------------------------------------------------------
(* Properties (FairSpec). *)

\* Nothing of i is left anywhere: the worker is done with it (or dead), no
\* message names it, the registry has no record, the engine holds nothing.
Settled(i) ==
    /\ rpcs[RpcOf(i)] # "idle" /\ ~Pending(RpcOf(i))
    /\ ws[i] \in RequestTerminal \cup {"READY", "FAILED"} \/ ~alive[ReplyRank]
    /\ packing # i /\ ~CdToCome(i)
    /\ ~\E r \in Ranks : \E m \in MsgsOf(r) : m.id = i
    /\ rec[i].st = "NONE" /\ rec[i].eng \in {"none", "done"} /\ rec[i].seg # "leased"

\* Every submitted request reaches a terminal state and leaves nothing behind,
\* also when a worker crashes.
RequestsTerminate == \A k \in RpcIds : rpcs[k] # "idle" ~> \A i \in Range(Batch[k]) : Settled(i)

\* Every waiter is eventually resolved.
WaitersResolve == \A i \in Ids : rec[i].waiter = "waiting" ~> rec[i].waiter # "waiting"

\* Every RPC is eventually resolved.
RpcsResolve == \A k \in RpcIds : Pending(k) ~> ~Pending(k)

=============================================================================
