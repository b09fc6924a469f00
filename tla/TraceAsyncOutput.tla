-------------------------- MODULE TraceAsyncOutput --------------------------
(***************************************************************************)
(* Trace validation: TLC replays traces recorded by the implementation     *)
(* (omni_async.core.trace, through ListTracer) against AsyncOutput, the    *)
(* model-checked spec itself, one recorded event per step.                 *)
(*                                                                         *)
(* omni_async.verify.tracecheck writes the module TraceData next to this   *)
(* one:                                                                    *)
(*   TraceLog  the events of every trace, one after the other, each trace  *)
(*             closed by an "End" event (many traces, one TLC run);        *)
(*   NumIds, NumRpcs, MaxRank  the sizes of the id, RPC and rank domains   *)
(*             (ids and RPCs are numbered per trace, from 1);              *)
(*   NumTraces, TBatch, TChunks, TSteps, TCons, TRanks, TReply, TNumIds    *)
(*             per trace, the constants of its INSTANCE of AsyncOutput     *)
(*             (AO(t) below).                                              *)
(* Every event is a record [a: action, o: output id (0: none), e: event,   *)
(* s: source state, d: target state, x: kind, outcome, reason or consumer, *)
(* k: RPC (0: none), n: a count, r: rank (-1: none; RpcSubmit: the reply   *)
(* rank), ok: BOOLEAN (Late: expected; FailAll: close), ids: a set of      *)
(* output ids, rk: a set of ranks, u: PumpRecv of a message of a call the  *)
(* executor never made (a faulty peer's)] and, on the first event of a     *)
(* registry or dispatcher call, the step of AsyncOutput that call is       *)
(* [g: its kind, gs: the records an expiry ends, cw / cr: the waiters and  *)
(* calls whose Future the engine cancelled first, gx: consumer or outcome, *)
(* gv: the dispatcher's call, gc: a fail_all that closes]                  *)
(* (tracecheck._steps).                                                    *)
(*                                                                         *)
(* Two layers check every trace:                                           *)
(*                                                                         *)
(* 1. AsyncOutput.  The state of the executor half of AsyncOutput (its     *)
(*    variables pump, closed, dead, submitted, rpcs, answers, rec, perr,   *)
(*    gone) is part of this spec's state.  Each call the implementation    *)
(*    records (a message the pump handled, a CHUNK included, a submit, an  *)
(*    abort of a call in flight (RpcCancel: AbortRpc), the close of a      *)
(*    stream (StreamClose: CloseStream), a wait, a cancel, a               *)
(*    drop, an expiry, a compute timeout, a forget, a consumer's release,  *)
(*    a fail_all) is one step of AsyncOutput (AOStep), taken when its      *)
(*    first event is: the step must be enabled, and when the next call     *)
(*    begins (or the trace ends) AsyncOutput's state must agree with what  *)
(*    the recorded events did (Agrees: every record's state, waiter,       *)
(*    payload and tombstone, every call pending or resolved the same way,  *)
(*    protocol errors, the registry closed or not).  Steps of AsyncOutput  *)
(*    that nothing records, the engine cancelling a waiter's or a call's   *)
(*    Future, are taken silently right before the call that shows them     *)
(*    (CancelWait, CancelRpc).  The worker half of AsyncOutput is not      *)
(*    recorded by the executor: its variables are mapped to constants (the *)
(*    executor's steps leave them unchanged), and the pump's step is       *)
(*    AsyncOutput's Handle of the recorded message, whatever the workers   *)
(*    sent (a faulty peer included).  Change AsyncOutput's executor half   *)
(*    and recorded runs are held to the change.                            *)
(*                                                                         *)
(* 2. The events inside each step.  Every request-state change must be an  *)
(*    entry of the generated RequestTable from the record's current state  *)
(*    and justified by the call it belongs to (call boundaries: PumpRecv,  *)
(*    WaiterAdd, Drop, Cancel, ReleaseConsumer, Expire, FailAll, and the   *)
(*    dispatcher's DispatchDrop and RpcResolve of a fail_all or            *)
(*    release_consumer open a call; every DROP, ABANDON and FORCE_RELEASE, *)
(*    every waiter failed with an error, must belong to the call that is   *)
(*    open, and a call must have done all it owes (every record of a       *)
(*    fail_all force-released, every record of the consumer abandoned,     *)
(*    exactly `count` records expired) before the next one opens); a      *)
(*    payload is stored or released once; worker events (WorkerFire)       *)
(*    follow the table.  This layer points at the very event that went     *)
(*    wrong; the first one says the call as a whole is AsyncOutput's.      *)
(*                                                                         *)
(* The behaviour is deterministic: step l consumes TraceLog[l] if, and     *)
(* only if, it is a step of the protocol from the current state.  TLC runs *)
(* with deadlock checking on: when no step matches, TLC reports a deadlock *)
(* and the last state's l names the event that was refused.  Done, at the  *)
(* end of the log, stutters so a full replay is no deadlock.               *)
(***************************************************************************)
EXTENDS Integers, FiniteSets, Sequences, TLC, RequestTable, TraceData

Oids == 1..NumIds
Rpcs == 1..NumRpcs
AllRanks == 0..MaxRank
NoEvents == {}

VARIABLES
    l,            \* events consumed
    st,           \* [Oids -> RequestStates \cup {"NONE"}]: registry record state
    waiter,       \* [Oids -> BOOLEAN]: a waiter is registered
    held,         \* [Oids -> {"none", "output", "failure", "delivered"}]: the record's payload
    dropped,      \* [Oids -> BOOLEAN]: DROP fired for the id in this trace
    mustFire,     \* [Oids -> SUBSET RequestEvents]: a failed waiter's record must move next
    seen,         \* [Oids -> SUBSET {"cd", "out"}]: the record's messages that arrived
    finished,     \* [Oids -> BOOLEAN]: the id's record was removed (it has a tombstone)
    expect,       \* [Oids -> SUBSET {"cd", "out"}]: the late messages its tombstone swallows
    expired,      \* [Oids -> BOOLEAN]: the record's output deadline passed (it is armed once)
    ghost,        \* [Oids -> BOOLEAN]: a COMPUTE_DONE of a call never made announced it (M6)
    owner,        \* [Oids -> STRING]: the consumer of the call that announced it ("": none)
    wst,          \* [Oids -> RequestStates \cup {"NONE"}]: the worker's machine of the id
    msg,          \* the message the pump is handling (the last PumpRecv)
    mx,           \* what the registry and the dispatcher did with it (see PumpRecv)
    cdPending,    \* ids of that COMPUTE_DONE the registry has not handled yet
    outPending,   \* that OUTPUT_READY has not been handled yet
    msgPayload,   \* that OUTPUT_READY's output has not been stored or released yet
    call,         \* the registry call that is open (see CallDone)
    rpc,          \* [Rpcs -> {"none", "pending", "done"}]
    rranks,       \* [Rpcs -> SUBSET AllRanks]: the ranks an RPC went to
    rrep,         \* [Rpcs -> AllRanks \cup {-1}]: its reply rank
    rcons,        \* [Rpcs -> STRING]: its consumer ("": none)
    rans,          \* [Rpcs -> [AllRanks -> {"none", "ok", "failed"}]]
    cdRank,       \* [Rpcs -> AllRanks \cup {-1}]: the rank whose COMPUTE_DONE answered it
    announced,    \* [Rpcs -> SUBSET Oids]: the ids its COMPUTE_DONE named
    chunked,      \* [Rpcs -> SUBSET Oids]: the chunk ids its CHUNKs named (the registry accepted)
    shut,         \* the registry is closed (its Shutdown event)
    errs,         \* a ProtocolError was recorded in this trace
    rout,         \* [Rpcs -> STRING]: how each call resolved ("": not yet)
    \* AsyncOutput's executor half, for the trace being replayed:
    pump, closed, dead, submitted, rpcs, answers, rec, perr, gone, abortSent, closedStreams,
    tr            \* the trace being replayed (1..NumTraces)

\* The event layer's variables, l included; AsyncOutput's.
fine == <<l, st, waiter, held, dropped, mustFire, seen, finished, expect, expired, ghost, owner, wst, msg, mx,
          cdPending, outPending, msgPayload, call, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>
ao == <<pump, closed, dead, submitted, rpcs, answers, rec, perr, gone, abortSent, closedStreams>>
vars == <<fine, errs, rout, ao, tr>>

NoMsg == [kind |-> "NONE", o |-> 0, ok |-> FALSE, k |-> 0, r |-> -1, ids |-> {}, u |-> FALSE]

\* mx: acc, the ids whose COMPUTE_DONE the registry accepted; dd, the ids the
\* dispatcher dropped; refused, an id of the COMPUTE_DONE was refused (late or
\* a duplicate); good, it is the first answer of the reply rank to a pending
\* call; lateErr, the id whose unexpected late message must be refused next.
NoMx == [acc |-> {}, dd |-> {}, refused |-> FALSE, good |-> FALSE, lateErr |-> 0]

\* call: c, which call ("none", "recv", "wait", "drop", "cancel", "release",
\* "expire", "failall", "ddrop": a DispatchDrop, its Drop to come, "rpcfail" /
\* "rpcgone": the dispatcher's part of a fail_all / release_consumer, the
\* registry's to come, "done": a drop or cancel that made its one change);
\* o, its id; x, its outcome or consumer; n, the expiries still owed; cl, a
\* fail_all that closes; pend, the records it still has to end.
CallKinds == {"none", "recv", "wait", "drop", "cancel", "release", "expire", "failall", "ddrop",
              "rpcfail", "rpcgone", "done"}
Call(c, o, x, n, cl, pend) == [c |-> c, o |-> o, x |-> x, n |-> n, cl |-> cl, pend |-> pend]
NoCall == Call("none", 0, "", 0, FALSE, {})

TypeOK ==
    /\ l \in 0..Len(TraceLog)
    /\ st \in [Oids -> RequestStates \cup {"NONE"}]
    /\ waiter \in [Oids -> BOOLEAN]
    /\ held \in [Oids -> {"none", "output", "failure", "delivered"}]
    /\ dropped \in [Oids -> BOOLEAN]
    /\ mustFire \in [Oids -> SUBSET RequestEvents]
    /\ seen \in [Oids -> SUBSET {"cd", "out"}]
    /\ finished \in [Oids -> BOOLEAN]
    /\ expect \in [Oids -> SUBSET {"cd", "out"}]
    /\ expired \in [Oids -> BOOLEAN]
    /\ ghost \in [Oids -> BOOLEAN]
    /\ wst \in [Oids -> RequestStates \cup {"NONE"}]
    /\ mx.acc \subseteq Oids /\ mx.dd \subseteq Oids /\ mx.lateErr \in Oids \cup {0}
    /\ cdPending \subseteq Oids /\ outPending \in BOOLEAN /\ msgPayload \in BOOLEAN
    /\ call.c \in CallKinds /\ call.o \in Oids \cup {0} /\ call.n \in Nat /\ call.pend \subseteq Oids
    /\ rpc \in [Rpcs -> {"none", "pending", "done"}]
    /\ rranks \in [Rpcs -> SUBSET AllRanks]
    /\ rrep \in [Rpcs -> AllRanks \cup {-1}]
    /\ rans \in [Rpcs -> [AllRanks -> {"none", "ok", "failed"}]]
    /\ cdRank \in [Rpcs -> AllRanks \cup {-1}]
    /\ announced \in [Rpcs -> SUBSET Oids]
    /\ chunked \in [Rpcs -> SUBSET Oids]
    /\ shut \in BOOLEAN

\* The state at the start of every trace (everything but l).
NoneSt == [o \in Oids |-> "NONE"]
NoWaiter == [o \in Oids |-> FALSE]
NoHeld == [o \in Oids |-> "none"]
NoFire == [o \in Oids |-> NoEvents]
NoSeen == [o \in Oids |-> {}]
NoOwner == [o \in Oids |-> ""]
NoRpc == [k \in Rpcs |-> "none"]
NoRanks == [k \in Rpcs |-> {}]
NoCons == [k \in Rpcs |-> ""]
NoAnswers == [k \in Rpcs |-> [r \in AllRanks |-> "none"]]
NoCdRank == [k \in Rpcs |-> -1]
Fresh ==
    /\ st = NoneSt /\ waiter = NoWaiter /\ held = NoHeld /\ dropped = NoWaiter
    /\ mustFire = NoFire /\ seen = NoSeen /\ finished = NoWaiter /\ expect = NoSeen
    /\ expired = NoWaiter /\ ghost = NoWaiter /\ owner = NoOwner
    /\ wst = NoneSt /\ msg = NoMsg /\ mx = NoMx
    /\ cdPending = {} /\ outPending = FALSE /\ msgPayload = FALSE /\ call = NoCall
    /\ rpc = NoRpc /\ rranks = NoRanks /\ rrep = NoCdRank /\ rcons = NoCons
    /\ rans = NoAnswers /\ cdRank = NoCdRank /\ announced = NoRanks /\ chunked = NoRanks /\ shut = FALSE

\* The same, for the next state (TLC cannot assign through a primed definition).
FreshNext ==
    /\ st' = NoneSt /\ waiter' = NoWaiter /\ held' = NoHeld /\ dropped' = NoWaiter
    /\ mustFire' = NoFire /\ seen' = NoSeen /\ finished' = NoWaiter /\ expect' = NoSeen
    /\ expired' = NoWaiter /\ ghost' = NoWaiter /\ owner' = NoOwner
    /\ wst' = NoneSt /\ msg' = NoMsg /\ mx' = NoMx
    /\ cdPending' = {} /\ outPending' = FALSE /\ msgPayload' = FALSE /\ call' = NoCall
    /\ rpc' = NoRpc /\ rranks' = NoRanks /\ rrep' = NoCdRank /\ rcons' = NoCons
    /\ rans' = NoAnswers /\ cdRank' = NoCdRank /\ announced' = NoRanks /\ chunked' = NoRanks /\ shut' = FALSE


Ev == TraceLog[l + 1]
Is(action) == l < Len(TraceLog) /\ Ev.a = action
Step == l' = l + 1

\* A state predicate used as a guard.  Compared with TRUE so that TLC evaluates it
\* as a value: inside an action TLC would unfold a quantifier into one nested
\* conjunct per element (one stack frame each, overflowing with many ids).
Holds(p) == p = TRUE

\* The message is fully handled and no record is left half-way.
MsgDone ==
    /\ cdPending = {} \/ shut
    /\ ~outPending \/ shut
    /\ ~msgPayload
    /\ mx.lateErr = 0
    /\ \A o \in Oids :
          /\ mustFire[o] = NoEvents
          /\ st[o] \notin RequestTerminal
          /\ held[o] \in {"output", "failure"} => st[o] \in RequestHolding
          /\ held[o] # "delivered"

\* ... and the open call has done all it owes: checked before the next call opens.
CallDone ==
    /\ MsgDone
    /\ call.c \notin {"ddrop", "rpcfail", "rpcgone"}
    /\ call.n = 0 /\ call.pend = {}
    /\ call.c = "failall" /\ call.cl => shut

\* ... and a COMPUTE_DONE that announced nothing to its call (an orphan, a
\* rank that is not the reply rank, a second answer, an id refused) had every
\* id the registry accepted of it dropped by the dispatcher: checked before the
\* pump takes the next message and at the end of a trace.
Settled ==
    /\ CallDone
    /\ msg.ids # {} /\ (~mx.good \/ mx.refused) => mx.acc \subseteq mx.dd

-----------------------------------------------------------------------------
(* Executor-side events: Dispatcher.handle and OutputRegistry.            *)

\* The pump dequeued a message (PumpRecvComputeDone / PumpRecvOutputReady /
\* PumpRecvRpcResult).  A traced worker must have reached the state in which
\* it sends that message.  Every id it names must be handled: by a record, or
\* by a Late event (its tombstone swallows it, or it is refused).
TracePumpRecv ==
    /\ Is("PumpRecv") /\ Holds(Settled)
    /\ Ev.x \in {"COMPUTE_DONE", "OUTPUT_READY", "RPC_RESULT", "CHUNK"}
    /\ Holds(\A o \in Ev.ids : wst[o] \notin {"QUEUED", "COMPUTING"})
    \* a CHUNK names its one id (output_id), announced like a COMPUTE_DONE's
    /\ Ev.x = "CHUNK" => Ev.o # 0 /\ Ev.ids = {} /\ wst[Ev.o] \notin {"QUEUED", "COMPUTING"}
    /\ Ev.x = "OUTPUT_READY" =>
          wst[Ev.o] \in {"NONE", "PACKING", "READY", "FAILED", "DROPPING", "DROPPED"}
    \* a message that names ids: a COMPUTE_DONE, or the failure that replaces one
    /\ LET good == /\ Ev.ids # {} /\ Ev.k \in Rpcs /\ rpc[Ev.k] = "pending"
                   /\ Ev.r = rrep[Ev.k] /\ rans[Ev.k][Ev.r] = "none"
       IN /\ mx' = [NoMx EXCEPT !.good = good]
          \* what the registry accepts of it (refused ids are taken out below)
          /\ announced' = IF good THEN [announced EXCEPT ![Ev.k] = Ev.ids] ELSE announced
    \* a call the executor says it never made (u) was never submitted in this trace
    /\ Ev.u => Ev.x # "OUTPUT_READY" /\ (Ev.k \in Rpcs => rpc[Ev.k] = "none")
    /\ msg' = [kind |-> Ev.x, o |-> Ev.o, ok |-> Ev.ok, k |-> Ev.k, r |-> Ev.r, ids |-> Ev.ids, u |-> Ev.u]
    /\ cdPending' = IF Ev.x = "CHUNK" THEN {Ev.o} ELSE Ev.ids
    /\ outPending' = (Ev.x = "OUTPUT_READY")
    /\ msgPayload' = (Ev.x = "OUTPUT_READY" /\ Ev.ok)
    /\ call' = Call("recv", 0, "", 0, FALSE, {})
    /\ Step
    /\ UNCHANGED <<ghost, st, waiter, held, dropped, mustFire, seen, finished, expect, expired, owner, wst,
                   rpc, rranks, rrep, rcons, rans, cdRank, chunked, shut>>

\* _late_message: a message of an id that already finished.  Expected only if
\* its tombstone still expects that message (a force-released id's message
\* still in flight); it is then swallowed.  Otherwise a ProtocolError follows.
TraceLate ==
    /\ Is("Late") /\ mx.lateErr = 0
    /\ st[Ev.o] = "NONE" /\ finished[Ev.o]
    /\ IF Ev.x = "cd" THEN Ev.o \in cdPending ELSE outPending /\ msg.o = Ev.o
    /\ Ev.ok = (Ev.x \in expect[Ev.o])
    /\ IF Ev.ok
       THEN /\ expect' = [expect EXCEPT ![Ev.o] = @ \ {Ev.x}]
            /\ cdPending' = cdPending \ {Ev.o}
            /\ outPending' = (outPending /\ Ev.x = "cd")
            \* not announced by this call: on_compute_done leaves it out
            /\ announced' = IF Ev.x = "cd" /\ mx.good THEN [announced EXCEPT ![msg.k] = @ \ {Ev.o}] ELSE announced
            /\ mx' = [mx EXCEPT !.refused = @ \/ Ev.x = "cd"]
       ELSE /\ mx' = [mx EXCEPT !.lateErr = Ev.o]
            /\ UNCHANGED <<expect, cdPending, outPending, announced>>
    /\ Step
    /\ UNCHANGED <<ghost, st, waiter, held, dropped, mustFire, seen, finished, expired, owner, wst, msg, msgPayload,
                   call, rpc, rranks, rrep, rcons, rans, cdRank, chunked, shut>>

\* _get_or_create: only for an id the current message names, never when closed.
TraceCreate ==
    /\ Is("Create") /\ ~shut
    /\ st[Ev.o] = "NONE" /\ ~finished[Ev.o]
    /\ Ev.o \in cdPending \/ (outPending /\ msg.o = Ev.o)
    /\ st' = [st EXCEPT ![Ev.o] = RegistryInitial]
    /\ waiter' = [waiter EXCEPT ![Ev.o] = FALSE]
    /\ held' = [held EXCEPT ![Ev.o] = "none"]
    /\ seen' = [seen EXCEPT ![Ev.o] = {}]
    /\ expired' = [expired EXCEPT ![Ev.o] = FALSE]
    /\ owner' = [owner EXCEPT ![Ev.o] = ""]
    /\ Step
    /\ UNCHANGED <<ghost, dropped, mustFire, finished, expect, wst, msg, mx, cdPending, outPending, msgPayload,
                   call, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* The event that the open call may make o take, besides arriving messages
\* and deliveries: a drop of o DROPs it; a cancel of o, an expiry (of a record
\* whose deadline is armed: its COMPUTE_DONE arrived) or a consumer's release
\* (of the records it owned when the call began) ABANDONs it; a fail_all
\* FORCE_RELEASEs every record that existed when it began; while a message is
\* handled, only a claim that finds its waiter cancelled (F3) ABANDONs.
CtxEvent(o) ==
    CASE call.c = "drop" /\ call.o = o -> "DROP"
      [] call.c = "cancel" /\ call.o = o -> "ABANDON"
      [] call.c = "release" /\ o \in call.pend -> "ABANDON"
      \* an early record (its COMPUTE_DONE unseen) is given up on: force-released;
      \* so is a DROPPING record a call never made announced (M6)
      [] call.c = "expire" /\ call.n > 0 /\ ~expired[o] ->
            IF "cd" \in seen[o] /\ ~(ghost[o] /\ st[o] = "DROPPING") THEN "ABANDON" ELSE "FORCE_RELEASE"
      [] call.c = "failall" /\ o \in call.pend -> "FORCE_RELEASE"
      [] call.c = "recv" /\ st[o] \in {"READY", "FAILED"} -> "ABANDON"
      [] OTHER -> "NONE"

\* Why the event may fire now, besides the table.
Justified(o, e) ==
    CASE e = "COMPUTE_DONE" -> o \in cdPending
      [] e \in {"OUTPUT_READY", "OUTPUT_FAILED"} ->
            outPending /\ msg.o = o /\ (e = "OUTPUT_READY") = msg.ok
      [] e = "DELIVER" -> waiter[o]
      [] e \in {"DROP", "ABANDON", "FORCE_RELEASE"} ->
            /\ ~waiter[o] /\ CtxEvent(o) = e
            \* the claim race: only right after the claim found the waiter cancelled
            /\ call.c = "recv" => mustFire[o] = {"ABANDON"}
      [] OTHER -> FALSE

\* What the change settles of the open call.
CallAfter(o, e) ==
    CASE e = "DROP" -> [call EXCEPT !.c = "done"]
      [] e = "ABANDON" /\ call.c = "cancel" -> [call EXCEPT !.c = "done"]
      [] e \in {"ABANDON", "FORCE_RELEASE"} /\ call.c = "expire" -> [call EXCEPT !.n = @ - 1]
      [] e \in {"ABANDON", "FORCE_RELEASE"} -> [call EXCEPT !.pend = @ \ {o}]
      [] OTHER -> call

\* _fire: one transition of the generated table.
TraceFire ==
    /\ Is("Fire")
    /\ LET o == Ev.o
           e == Ev.e
       IN /\ st[o] = Ev.s
          /\ RequestCan(Ev.s, e) /\ RequestNext(Ev.s, e) = Ev.d
          /\ Justified(o, e)
          /\ mustFire[o] # NoEvents => e \in mustFire[o]
          /\ st' = [st EXCEPT ![o] = Ev.d]
          /\ mustFire' = [mustFire EXCEPT ![o] = NoEvents]
          /\ dropped' = IF e = "DROP" THEN [dropped EXCEPT ![o] = TRUE] ELSE dropped
          /\ cdPending' = IF e = "COMPUTE_DONE" THEN cdPending \ {o} ELSE cdPending
          /\ outPending' = IF e \in {"OUTPUT_READY", "OUTPUT_FAILED"} THEN FALSE ELSE outPending
          \* An arriving output is stored in a holding state, else released at once;
          \* a held failure is discarded with the record.
          /\ held' = CASE e \in {"OUTPUT_READY", "OUTPUT_FAILED"} /\ Ev.d \in RequestHolding ->
                             [held EXCEPT ![o] = IF e = "OUTPUT_READY" THEN "output" ELSE "failure"]
                       [] e \in {"DROP", "ABANDON", "FORCE_RELEASE"} /\ held[o] = "failure" ->
                             [held EXCEPT ![o] = "none"]
                       [] OTHER -> held
          /\ msgPayload' = IF e = "OUTPUT_READY" /\ Ev.d \in RequestHolding THEN FALSE ELSE msgPayload
          /\ seen' = CASE e = "COMPUTE_DONE" -> [seen EXCEPT ![o] = @ \cup {"cd"}]
                       [] e \in {"OUTPUT_READY", "OUTPUT_FAILED"} -> [seen EXCEPT ![o] = @ \cup {"out"}]
                       [] OTHER -> seen
          \* on_compute_done: the record belongs to the consumer of the call it answers
          /\ owner' = IF e = "COMPUTE_DONE"
                      THEN [owner EXCEPT ![o] = IF msg.k \in Rpcs /\ rpc[msg.k] = "pending" THEN rcons[msg.k] ELSE ""]
                      ELSE owner
          /\ mx' = IF e = "COMPUTE_DONE" THEN [mx EXCEPT !.acc = @ \cup {o}] ELSE mx
          \* a CHUNK's id: a chunk of its call (what the call's end or a close may drop)
          /\ chunked' = IF e = "COMPUTE_DONE" /\ msg.kind = "CHUNK" /\ msg.k \in Rpcs
                        THEN [chunked EXCEPT ![msg.k] = @ \cup {o}] ELSE chunked
          /\ ghost' = IF e = "COMPUTE_DONE" /\ msg.u THEN [ghost EXCEPT ![o] = TRUE] ELSE ghost
          /\ expired' = IF e \in {"ABANDON", "FORCE_RELEASE"} /\ call.c = "expire" THEN [expired EXCEPT ![o] = TRUE] ELSE expired
          /\ call' = CallAfter(o, e)
    /\ Step
    /\ UNCHANGED <<waiter, finished, expect, wst, msg, rpc, rranks, rrep, rcons, rans, cdRank, announced, shut>>

\* The record is removed the moment it is terminal, with nothing left in it;
\* its tombstone expects the messages it has not seen.
TraceRemove ==
    /\ Is("Remove")
    /\ st[Ev.o] = Ev.d /\ Ev.d \in RequestTerminal
    /\ ~waiter[Ev.o] /\ held[Ev.o] = "none"
    /\ st' = [st EXCEPT ![Ev.o] = "NONE"]
    /\ finished' = [finished EXCEPT ![Ev.o] = TRUE]
    /\ expect' = [expect EXCEPT ![Ev.o] = {"cd", "out"} \ seen[Ev.o]]
    /\ Step
    /\ UNCHANGED <<ghost, waiter, held, dropped, mustFire, seen, expired, owner, wst, msg, mx, cdPending, outPending,
                   msgPayload, call, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* wait: a live record that is still wanted gets one waiter (opens the call).
TraceWaiterAdd ==
    /\ Is("WaiterAdd") /\ ~shut /\ Holds(CallDone)
    /\ st[Ev.o] \notin {"NONE", "DROPPING", "DROPPING_EARLY", "RELEASING", "RELEASING_EARLY"}
    /\ ~waiter[Ev.o]
    /\ waiter' = [waiter EXCEPT ![Ev.o] = TRUE]
    /\ call' = Call("wait", Ev.o, "", 0, FALSE, {})
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* A waiter is resolved once: with the output it was delivered, with the
\* failure the record held, or with an error by the open call, after which
\* the record must take that call's event: "dropped" by a drop or a
\* consumer's release, "timeout" by an expiry, the fail_all's own outcome by
\* a fail_all; "cancelled" whenever the Future was found cancelled (F3).
TraceWaiterResolve ==
    /\ Is("WaiterResolve")
    /\ waiter[Ev.o]
    /\ waiter' = [waiter EXCEPT ![Ev.o] = FALSE]
    /\ CASE Ev.x = "output" ->
              /\ st[Ev.o] = "DELIVERED" /\ held[Ev.o] = "delivered"
              /\ held' = [held EXCEPT ![Ev.o] = "none"]
              /\ UNCHANGED mustFire
         [] Ev.x = "failure" ->
              /\ st[Ev.o] = "DELIVERED" /\ held[Ev.o] = "failure"
              /\ held' = [held EXCEPT ![Ev.o] = "none"]
              /\ UNCHANGED mustFire
         [] OTHER ->
              /\ CtxEvent(Ev.o) # "NONE"
              /\ (CASE Ev.x = "cancelled" -> TRUE
                    [] Ev.x = "dropped" -> call.c \in {"drop", "release"}
                    [] Ev.x \in {"timeout", "orphaned"} -> call.c = "expire"
                    [] OTHER -> call.c = "failall" /\ call.x = Ev.x)
              /\ mustFire' = [mustFire EXCEPT ![Ev.o] = {CtxEvent(Ev.o)}]
              /\ UNCHANGED held
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, dropped, wst, msg, mx, cdPending, outPending,
                   msgPayload, call, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* The delivered output goes to the waiter; never after a drop.
TracePayloadDeliver ==
    /\ Is("PayloadDeliver")
    /\ st[Ev.o] = "DELIVERED" /\ held[Ev.o] = "output" /\ ~dropped[Ev.o]
    /\ held' = [held EXCEPT ![Ev.o] = "delivered"]
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, call, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* A payload is released once: the one a record held (it left a holding
\* state), or the one the current message brought when nobody may have it
\* (the id's record ended on arrival, the message was a duplicate, or late,
\* or the registry is closed and the id never had a record).
TracePayloadRelease ==
    /\ Is("PayloadRelease")
    /\ IF held[Ev.o] = "output" /\ st[Ev.o] \notin RequestHolding
       THEN /\ held' = [held EXCEPT ![Ev.o] = "none"]
            /\ UNCHANGED <<msgPayload, outPending>>
       ELSE /\ msgPayload /\ msg.o = Ev.o
            /\ ~outPending \/ (shut /\ st[Ev.o] = "NONE" /\ ~finished[Ev.o])
            /\ msgPayload' = FALSE
            /\ outPending' = FALSE
            /\ UNCHANGED held
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, dropped, mustFire, wst, msg, mx,
                   cdPending, call, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* A message the table does not allow is refused, and the state stays.  A
\* finished id's message is refused only after its Late event said so.
TraceProtocolError ==
    /\ Is("ProtocolError")
    /\ msg # NoMsg
    /\ IF Ev.o = 0
       THEN UNCHANGED <<cdPending, outPending, announced, mx>>  \* the dispatcher's (wrong rank, duplicate answer)
       ELSE /\ mx.lateErr = (IF st[Ev.o] = "NONE" THEN Ev.o ELSE 0)
            /\ \/ /\ Ev.o \in cdPending /\ (msg.ids # {} \/ msg.kind = "CHUNK")
                  /\ st[Ev.o] \notin RequestAwaitingComputeDone
                  /\ cdPending' = cdPending \ {Ev.o}
                  \* a refused id belongs to another call: not announced by this one
                  /\ announced' = IF mx.good THEN [announced EXCEPT ![msg.k] = @ \ {Ev.o}] ELSE announced
                  /\ mx' = [mx EXCEPT !.refused = TRUE, !.lateErr = 0]
                  /\ UNCHANGED outPending
               \/ /\ outPending /\ msg.o = Ev.o
                  /\ st[Ev.o] # "NONE" => ~RequestCan(st[Ev.o], IF msg.ok THEN "OUTPUT_READY" ELSE "OUTPUT_FAILED")
                  /\ outPending' = FALSE
                  /\ mx' = [mx EXCEPT !.lateErr = 0]
                  /\ UNCHANGED <<cdPending, announced>>
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, msgPayload,
                   call, rpc, rranks, rrep, rcons, rans, cdRank, chunked, shut>>

-----------------------------------------------------------------------------
(* Call boundaries of the registry. *)

\* drop (the engine's, or the dispatcher's right after its DispatchDrop).
TraceDrop ==
    /\ Is("Drop")
    /\ Holds(CallDone) \/ (call.c = "ddrop" /\ call.o = Ev.o /\ Holds(MsgDone))
    /\ call' = Call("drop", Ev.o, "", 0, FALSE, {})
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* cancel: the done-callback of a cancelled waiter.
TraceCancel ==
    /\ Is("Cancel") /\ Holds(CallDone)
    /\ call' = Call("cancel", Ev.o, "", 0, FALSE, {})
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* release_consumer: every record the consumer owns now must be abandoned
\* (after the dispatcher failed the consumer's pending calls, if it did).
TraceReleaseConsumer ==
    /\ Is("ReleaseConsumer")
    /\ Holds(CallDone) \/ (call.c = "rpcgone" /\ call.x = Ev.x /\ Holds(MsgDone))
    /\ call' = Call("release", 0, Ev.x, 0, FALSE, {o \in Oids : st[o] # "NONE" /\ owner[o] = Ev.x})
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* expire: exactly `count` records with an armed deadline are abandoned.
TraceExpire ==
    /\ Is("Expire") /\ Holds(CallDone) /\ Ev.n >= 1
    /\ call' = Call("expire", 0, "", Ev.n, FALSE, {})
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* fail_all (worker death; with close, shutdown): every record that exists
\* now must be force-released, its waiter failed with this outcome; the
\* dispatcher's part (its pending calls failed with the same outcome) comes first.
TraceFailAll ==
    /\ Is("FailAll")
    /\ Holds(CallDone) \/ (call.c = "rpcfail" /\ call.x = Ev.x /\ Holds(MsgDone))
    /\ call' = Call("failall", 0, Ev.x, 0, Ev.ok, {o \in Oids : st[o] # "NONE"})
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* fail_all(close=True) closes the registry first: nothing is created afterwards.
\* Idempotent: a repeated shutdown changes nothing.
TraceShutdown ==
    /\ Is("Shutdown") /\ call.c = "failall" /\ call.cl
    /\ shut' = TRUE
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, call, rpc, rranks, rrep, rcons, rans, cdRank, chunked, announced>>

-----------------------------------------------------------------------------
(* RPC events: Dispatcher (F12). *)

\* Dispatcher.cancel: the engine aborted every request of a pending call
\* (cancel_requests); AsyncOutput's AbortRpc is the step.  Nothing changes
\* here until the call's answers come.
TraceRpcCancel ==
    /\ Is("RpcCancel") /\ rpc[Ev.k] = "pending"
    /\ Holds(CallDone)
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, expired, ghost, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, call, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* Dispatcher.close_stream: the engine closed a stream of call k; AsyncOutput's
\* CloseStream is the step, its drops (DispatchDrop "closed") follow.
TraceStreamClose ==
    /\ Is("StreamClose") /\ Ev.k \in Rpcs
    /\ Holds(CallDone)
    /\ call' = NoCall
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, expired, ghost, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

TraceRpcSubmit ==
    /\ Is("RpcSubmit") /\ rpc[Ev.k] = "none" /\ Ev.rk # {} /\ Ev.r \in Ev.rk
    /\ Holds(CallDone)
    /\ rpc' = [rpc EXCEPT ![Ev.k] = "pending"]
    /\ rranks' = [rranks EXCEPT ![Ev.k] = Ev.rk]
    /\ rrep' = [rrep EXCEPT ![Ev.k] = Ev.r]
    /\ rcons' = [rcons EXCEPT ![Ev.k] = Ev.x]
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, call, rans, cdRank, announced, chunked, shut>>

\* One answer per rank, from the message being handled.  A COMPUTE_DONE
\* answers well only if it is the reply rank's first answer and the registry
\* accepted every id it names; otherwise it is turned into a failure.
TraceRpcAnswer ==
    /\ Is("RpcAnswer")
    /\ rpc[Ev.k] = "pending" /\ Ev.r \in rranks[Ev.k] /\ rans[Ev.k][Ev.r] = "none"
    /\ msg.k = Ev.k /\ msg.r = Ev.r /\ msg.kind \in {"COMPUTE_DONE", "RPC_RESULT"}
    /\ Ev.ok = IF msg.ids # {} THEN msg.ok /\ mx.good /\ ~mx.refused ELSE msg.ok
    /\ rans' = [rans EXCEPT ![Ev.k][Ev.r] = IF Ev.ok THEN "ok" ELSE "failed"]
    /\ cdRank' = IF msg.ids # {} /\ mx.good /\ ~mx.refused THEN [cdRank EXCEPT ![Ev.k] = Ev.r] ELSE cdRank
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, call, rpc, rranks, rrep, rcons, announced, chunked, shut>>

AllAnswered(k) == \A r \in rranks[k] : rans[k][r] # "none"
AnyFailed(k) == \E r \in rranks[k] : rans[k][r] = "failed"

\* Why the dispatcher may drop an id: what the call's reply rank announced,
\* when the call fails, is cancelled or times out (F12); every id the
\* registry accepted of a COMPUTE_DONE that announces nothing to its call
\* (an orphan: the call is gone; rejected: not the reply rank's first answer,
\* or an id of it refused).
\* A chunk that arrives for a pending call nobody wants (its stream closed,
\* the call aborted: "unwanted"; its Future cancelled: "cancelled"), or out of
\* place ("rejected"), is dropped on arrival; at the call's end the chunks it
\* did not hand out are dropped with its announced ids; a close drops a
\* stream's chunks ("closed").  AsyncOutput's step says which ones.
ChunkArrival(o, k) == msg.kind = "CHUNK" /\ msg.k = k /\ rpc[k] = "pending" /\ o \in mx.acc
EndDrop(o, k) == (cdRank[k] = rrep[k] /\ o \in announced[k]) \/ o \in chunked[k]
DispatchDropAllowed(o, k, reason) ==
    CASE reason = "orphan" ->
              /\ msg.ids # {} \/ msg.kind = "CHUNK"
              /\ msg.k = k /\ rpc[k] # "pending" /\ o \in mx.acc
      [] reason = "rejected" ->
              \/ /\ msg.ids # {} /\ msg.k = k /\ rpc[k] = "pending" /\ o \in mx.acc
                 /\ ~mx.good \/ mx.refused
              \/ ChunkArrival(o, k)
      [] reason = "unwanted" -> ChunkArrival(o, k)
      [] reason = "closed" -> o \in chunked[k]
      [] reason \in {"failed", "cancelled"} ->
              \/ /\ rpc[k] = "pending" /\ AllAnswered(k) /\ cdRank[k] = rrep[k] /\ o \in announced[k]
                 /\ AnyFailed(k) = (reason = "failed")
              \/ rpc[k] = "pending" /\ AllAnswered(k) /\ o \in chunked[k]
              \/ reason = "cancelled" /\ ChunkArrival(o, k)
      \* an aborted call (cancel_requests) that finished anyway: what it announced
      [] reason = "aborted" ->
              /\ rpc[k] = "pending" /\ AllAnswered(k) /\ EndDrop(o, k)
              /\ k \in abortSent
      \* a compute timeout, or a broadcast that failed part-way (Dispatcher.forget)
      [] reason \in {"timeout", "unsent"} ->
              /\ rpc[k] = "pending" /\ ~AllAnswered(k) /\ EndDrop(o, k)
      [] OTHER -> FALSE

TraceDispatchDrop ==
    /\ Is("DispatchDrop") /\ Holds(CallDone)
    /\ Holds(DispatchDropAllowed(Ev.o, Ev.k, Ev.x))
    /\ mx' = [mx EXCEPT !.dd = @ \cup {Ev.o}]
    /\ call' = Call("ddrop", Ev.o, "", 0, FALSE, {})
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg,
                   cdPending, outPending, msgPayload, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

\* An RPC resolves as success only when every rank answered, none failed and
\* the reply rank's COMPUTE_DONE answered it (F12), and every id it announced
\* has been registered; otherwise what it announced has been dropped.
ResolveAllowed(k, outcome) ==
    CASE outcome = "ok" ->
              /\ AllAnswered(k) /\ \A r \in rranks[k] : rans[k][r] = "ok"
              \* a step of step mode may end with the reply rank's plain answer (no output)
              /\ cdRank[k] = rrep[k] \/ (k \in TSteps[tr] /\ announced[k] = {})
              \* registered before the call resolves (ended already only if abandoned,
              \* e.g. by release_consumer while the call was pending)
              /\ \A o \in announced[k] :
                    IF st[o] = "NONE" THEN finished[o] ELSE st[o] \notin RequestAwaitingComputeDone
      [] outcome \in {"failed", "cancelled"} ->
              /\ AllAnswered(k)
              /\ outcome = "failed" => AnyFailed(k) \/ cdRank[k] = -1
              /\ \A o \in announced[k] : st[o] \in {"NONE", "DROPPING", "DROPPING_EARLY"}
      [] outcome \in {"timeout", "unsent"} ->
              \A o \in announced[k] : st[o] \in {"NONE", "DROPPING", "DROPPING_EARLY"}
      \* the engine aborted the call (its RpcCancel), every rank answered, what it
      \* announced (it finished anyway) has been dropped
      [] outcome = "aborted" ->
              /\ AllAnswered(k) /\ k \in abortSent
              /\ \A o \in announced[k] : st[o] \in {"NONE", "DROPPING", "DROPPING_EARLY"}
      \* release_consumer and fail_all: checked by the registry's part that follows
      [] OTHER -> TRUE

\* The dispatcher's part of release_consumer ("consumer_gone": the consumer's
\* ReleaseConsumer follows) and of fail_all (any other outcome: a FailAll with
\* the same outcome follows) opens the call; the others happen inside one.
TraceRpcResolve ==
    /\ Is("RpcResolve") /\ rpc[Ev.k] = "pending"
    /\ Holds(ResolveAllowed(Ev.k, Ev.x))
    /\ rpc' = [rpc EXCEPT ![Ev.k] = "done"]
    /\ IF Ev.x \in {"ok", "failed", "cancelled", "timeout", "unsent", "aborted"}
       THEN UNCHANGED call
       ELSE LET c == IF Ev.x = "consumer_gone" THEN "rpcgone" ELSE "rpcfail"
                x == IF Ev.x = "consumer_gone" THEN rcons[Ev.k] ELSE Ev.x
            IN /\ Holds(CallDone) \/ (call.c = c /\ call.x = x /\ Holds(MsgDone))
               /\ call' = Call(c, 0, x, 0, FALSE, {})
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, wst, msg, mx,
                   cdPending, outPending, msgPayload, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

-----------------------------------------------------------------------------
(* Worker-side events: WorkerLoop._fire and Packer._fire. *)

TraceWorkerFire ==
    /\ Is("WorkerFire")
    /\ LET src == IF wst[Ev.o] = "NONE" THEN RequestInitial ELSE wst[Ev.o] IN
       /\ src = Ev.s
       /\ Ev.e \in {"FORWARD", "COMPUTE_DONE", "PACK", "OUTPUT_READY", "OUTPUT_FAILED", "DROP", "FORCE_RELEASE"}
       /\ RequestCan(src, Ev.e) /\ RequestNext(src, Ev.e) = Ev.d
    /\ wst' = [wst EXCEPT ![Ev.o] = Ev.d]
    /\ Step
    /\ UNCHANGED <<ghost, st, seen, finished, expect, expired, owner, waiter, held, dropped, mustFire, msg, mx,
                   cdPending, outPending, msgPayload, call, rpc, rranks, rrep, rcons, rans, cdRank, announced, chunked, shut>>

-----------------------------------------------------------------------------
(* AsyncOutput, the model-checked spec: one instance per trace.            *)

\* The ids of trace t, as AsyncOutput names them (strings, like the model's).
Id(o) == ToString(o)
AOIds(t) == {Id(o) : o \in 1..TNumIds[t]}
AORpcs(t) == 1..Len(TBatch[t])

\* The worker half is not recorded: its variables are mapped to constants
\* (no executor step changes them).  The executor half is this spec's.
AO(t) == INSTANCE AsyncOutput WITH
    Ranks <- TRanks[t], ReplyRank <- TReply[t], Batch <- TBatch[t], Consumer <- TCons[t],
    Chunks <- TChunks[t], Steps <- TSteps[t],
    MaxCrashes <- 0, ForwardFails <- TRUE, PackFails <- TRUE, SendFails <- TRUE,
    EngineAborts <- TRUE, CancelsForward <- TRUE, MaxQueue <- 0, PackDepth <- 1,
    alive <- [r \in TRanks[t] |-> TRUE], mainPc <- [r \in TRanks[t] |-> "idle"],
    mainRpc <- [r \in TRanks[t] |-> 0], failedRanks <- [k \in AORpcs(t) |-> {}],
    ws <- [o \in AOIds(t) |-> "QUEUED"], packQ <- <<>>, packing <- <<>>,
    chan <- [r \in TRanks[t] |-> <<>>], sent <- [r \in TRanks[t] |-> 0],
    recvd <- [r \in TRanks[t] |-> 0], eof <- {}, crashes <- 0

\* AsyncOutput's Init, executor half, for trace t (and primed, for the next trace:
\* TLC cannot assign through a primed definition).
AOInit(t) ==
    /\ pump = "RUNNING" /\ closed = FALSE /\ dead = FALSE /\ submitted = 0
    /\ rpcs = [k \in AORpcs(t) |-> "idle"]
    /\ answers = [k \in AORpcs(t) |-> [r \in TRanks[t] |-> "none"]]
    /\ rec = [o \in AOIds(t) |-> AO(t)!NoRec]
    /\ perr = FALSE /\ gone = {} /\ abortSent = {} /\ closedStreams = {}
AOInitNext(t) ==
    /\ pump' = "RUNNING" /\ closed' = FALSE /\ dead' = FALSE /\ submitted' = 0
    /\ rpcs' = [k \in AORpcs(t) |-> "idle"]
    /\ answers' = [k \in AORpcs(t) |-> [r \in TRanks[t] |-> "none"]]
    /\ rec' = [o \in AOIds(t) |-> AO(t)!NoRec]
    /\ perr' = FALSE /\ gone' = {} /\ abortSent' = {} /\ closedStreams' = {}

Init == l = 0 /\ Fresh /\ errs = FALSE /\ rout = [k \in Rpcs |-> ""] /\ tr = 1 /\ AOInit(1)

\* What every recorded event adds to errs and rout.
Outcomes ==
    /\ errs' = (errs \/ Ev.a = "ProtocolError")
    /\ rout' = IF Ev.a = "RpcResolve" THEN [rout EXCEPT ![Ev.k] = Ev.x] ELSE rout

\* The message a PumpRecv event records, as AsyncOutput's Msg (a call the
\* executor never made: AsyncOutput's NoCall).
MsgOf(ev) ==
    [kind |-> ev.x, rpc |-> IF ev.u THEN 0 ELSE ev.k, id |-> IF ev.o = 0 THEN "-" ELSE Id(ev.o), ok |-> ev.ok,
     out |-> IF ev.x = "OUTPUT_READY" /\ ev.ok THEN Id(ev.o) ELSE "-", w |-> "main",
     ids |-> {Id(o) : o \in ev.ids}]

\* The step of AsyncOutput that the call opening at Ev makes.  A cancel finds
\* a waiter to abandon only if the engine cancelled it; otherwise it changes
\* nothing.
AOStep(t) ==
    CASE Ev.g = "submit"    -> AO(t)!Submit(Ev.k)
      [] Ev.g = "abort"     -> AO(t)!AbortRpc(Ev.k)
      [] Ev.g = "closestream" -> AO(t)!CloseStream(Ev.k)
      [] Ev.g = "recv"      -> /\ AO(t)!Handle(Ev.r, MsgOf(Ev))
                               /\ UNCHANGED <<pump, closed, dead, submitted, gone, abortSent, closedStreams>>
      [] Ev.g = "wait"      -> AO(t)!RegistryWait(Id(Ev.o))
      [] Ev.g = "cancel"    -> IF rec[Id(Ev.o)].waiter = "cancelled"
                               THEN AO(t)!RegistryCancelWaiter(Id(Ev.o))
                               ELSE UNCHANGED ao
      [] Ev.g = "drop"      -> AO(t)!DropOutput(Id(Ev.o))
      [] Ev.g = "expire"    -> AO(t)!ExpireOutputs({Id(o) : o \in Ev.gs})
      [] Ev.g = "rpcexpire" -> AO(t)!ExpireRpc(Ev.k)
      [] Ev.g = "unsent"    -> AO(t)!Forget(Ev.k)
      [] Ev.g = "release"   -> AO(t)!ReleaseConsumer(Ev.gx, Ev.gv)
      [] Ev.g = "failall"   -> AO(t)!FailAll(Ev.gc, Ev.gv)

\* What the recorded events did agrees with AsyncOutput's state: checked when
\* the next call opens, and at the end of the trace.
HeldAs(h) == IF h = "-" THEN "none" ELSE IF h = "failure" THEN "failure" ELSE "output"
\* How a call AsyncOutput resolved is recorded: "gone" as consumer_gone, and a
\* fail_all's calls with the fail_all's own outcome (shutdown, worker_died, ...).
ResolvedAs(s, out) ==
    CASE s \in {"idle", "pending", "cancelling"} -> out = ""
      [] s = "gone"                              -> out = "consumer_gone"
      [] s = "shutdown"                          ->
            out \notin {"", "ok", "failed", "cancelled", "timeout", "unsent", "consumer_gone", "aborted"}
      [] OTHER                                   -> out = s
Agrees(t) ==
    /\ closed = shut
    /\ perr = errs
    /\ \A o \in 1..TNumIds[t] :
          LET x == rec[Id(o)] IN
          /\ x.st = st[o]
          /\ (x.waiter # "none") = waiter[o]
          /\ HeldAs(x.held) = held[o]
          /\ ("fin" \in x.late) = finished[o]
          /\ x.late \ {"fin"} = expect[o]
    /\ \A k \in AORpcs(t) : AO(t)!Pending(k) = (k \in Rpcs /\ rpc[k] = "pending")
    /\ \A k \in AORpcs(t) : ResolvedAs(rpcs[k], rout[k])

\* The engine cancelled a waiter's or a call's Future, which nothing records:
\* AsyncOutput's CancelWait / CancelRpc, right before the call that shows it
\* (a waiter resolved "cancelled", a call resolved "cancelled"), one at a time.
WaitersToCancel == {o \in Ev.cw : rec[Id(o)].waiter = "waiting"}
CallsToCancel == {k \in Ev.cr : rpcs[k] = "pending"}
SilentCancel ==
    /\ l < Len(TraceLog) /\ Ev.g # ""
    /\ \E t \in {tr} :
          IF WaitersToCancel # {}
          THEN AO(t)!CancelWait(Id(CHOOSE o \in WaitersToCancel : TRUE))
          ELSE CallsToCancel # {} /\ AO(t)!CancelRpc(CHOOSE k \in CallsToCancel : TRUE)
    /\ UNCHANGED <<fine, errs, rout, tr>>

\* One recorded event: the event layer's step, and AsyncOutput's when it opens a call.
AOEvent ==
    IF Ev.g = "" THEN UNCHANGED <<ao, tr>>
    ELSE /\ WaitersToCancel = {} /\ CallsToCancel = {}
         /\ \E t \in {tr} : Holds(Agrees(t)) /\ AOStep(t)
         /\ UNCHANGED tr

-----------------------------------------------------------------------------
(* Trace boundaries. *)

\* The end of one trace: everything settled; after a shutdown nothing is
\* left: no record, no waiter, no pending RPC; AsyncOutput agrees.  Then the
\* next trace starts fresh.
TraceEnd ==
    /\ Is("End") /\ Holds(Settled)
    /\ Holds(shut => /\ \A o \in Oids : st[o] = "NONE" /\ ~waiter[o]
                      /\ \A k \in Rpcs : rpc[k] # "pending")
    /\ \E t \in {tr} : Holds(Agrees(t))
    /\ Step
    /\ FreshNext
    /\ errs' = FALSE /\ rout' = [k \in Rpcs |-> ""]
    /\ IF tr < NumTraces THEN tr' = tr + 1 /\ AOInitNext(tr + 1) ELSE UNCHANGED <<ao, tr>>

Done == l = Len(TraceLog) /\ UNCHANGED vars

TraceEvent ==
    \/ TracePumpRecv
    \/ TraceLate
    \/ TraceCreate
    \/ TraceFire
    \/ TraceRemove
    \/ TraceWaiterAdd
    \/ TraceWaiterResolve
    \/ TracePayloadDeliver
    \/ TracePayloadRelease
    \/ TraceProtocolError
    \/ TraceDrop
    \/ TraceCancel
    \/ TraceReleaseConsumer
    \/ TraceExpire
    \/ TraceFailAll
    \/ TraceShutdown
    \/ TraceRpcSubmit
    \/ TraceRpcCancel
    \/ TraceStreamClose
    \/ TraceRpcAnswer
    \/ TraceDispatchDrop
    \/ TraceRpcResolve
    \/ TraceWorkerFire

Next ==
    \/ TraceEvent /\ Outcomes /\ AOEvent
    \/ SilentCancel
    \/ TraceEnd
    \/ Done

Spec == Init /\ [][Next]_vars

=============================================================================
