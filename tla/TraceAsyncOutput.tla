-------------------------- MODULE TraceAsyncOutput --------------------------
(***************************************************************************)
(* Trace validation: TLC replays traces recorded by the implementation     *)
(* (omni_async.trace, through ListTracer) against the executor half of     *)
(* AsyncOutput, one recorded event per step.                               *)
(*                                                                         *)
(* omni_async.tracecheck writes the module TraceData next to this one:     *)
(*   TraceLog  the events of every trace, one after the other, each trace  *)
(*             closed by an "End" event (many traces, one TLC run);        *)
(*   NumIds, NumRpcs, MaxRank  the sizes of the id, RPC and rank domains   *)
(*             (ids and RPCs are numbered per trace, from 1).              *)
(* Every event is a record [a: action, o: output id (0: none), e: event,   *)
(* s: source state, d: target state, x: kind or outcome, k: RPC (0: none), *)
(* r: rank (-1: none), ok: BOOLEAN, ids: a set of output ids, rk: a set    *)
(* of ranks].                                                               *)
(*                                                                         *)
(* The behaviour is deterministic: step i consumes TraceLog[i] if, and     *)
(* only if, it is a step of the protocol from the current state.  Every    *)
(* request-state change must be an entry of the generated RequestTable.    *)
(* TLC runs with deadlock checking on: when no step matches, TLC reports a *)
(* deadlock and the last state's i names the event that was refused.       *)
(* Done, at the end of the log, stutters so a full replay is no deadlock.  *)
(***************************************************************************)
EXTENDS Integers, FiniteSets, Sequences, RequestTable, TraceData

Oids == 1..NumIds
Rpcs == 1..NumRpcs
Ranks == 0..MaxRank
NoEvents == {}

VARIABLES
    i,            \* events consumed
    st,           \* [Oids -> RequestStates \cup {"NONE"}]: registry record state
    waiter,       \* [Oids -> BOOLEAN]: a waiter is registered
    held,         \* [Oids -> {"none", "output", "failure", "delivered"}]: the record's payload
    dropped,      \* [Oids -> BOOLEAN]: DROP fired for the id in this trace
    mustFire,     \* [Oids -> SUBSET RequestEvents]: a failed waiter's record must move next
    seen,         \* [Oids -> SUBSET {"cd", "out"}]: the record's messages that arrived
    finished,     \* [Oids -> BOOLEAN]: the id's record was removed (it has a tombstone)
    expect,       \* [Oids -> SUBSET {"cd", "out"}]: the late messages its tombstone swallows
    wst,          \* [Oids -> RequestStates \cup {"NONE"}]: the worker's machine of the id
    msg,          \* the message the pump is handling (the last PumpRecv)
    cdPending,    \* ids of that COMPUTE_DONE the registry has not handled yet
    outPending,   \* that OUTPUT_READY has not been handled yet
    msgPayload,   \* that OUTPUT_READY's output has not been stored or released yet
    rpc,          \* [Rpcs -> {"none", "pending", "done"}]
    rranks,       \* [Rpcs -> SUBSET Ranks]: the ranks an RPC went to
    ans,          \* [Rpcs -> [Ranks -> {"none", "ok", "failed"}]]
    cdRank,       \* [Rpcs -> Ranks \cup {-1}]: the rank whose COMPUTE_DONE answered it
    announced,    \* [Rpcs -> SUBSET Oids]: the ids its COMPUTE_DONE named
    closed        \* the registry is closed

vars == <<i, st, waiter, held, dropped, mustFire, seen, finished, expect, wst, msg, cdPending, outPending, msgPayload,
          rpc, rranks, ans, cdRank, announced, closed>>

NoMsg == [kind |-> "NONE", o |-> 0, ok |-> FALSE, k |-> 0, r |-> -1, ids |-> {}]

TypeOK ==
    /\ i \in 0..Len(TraceLog)
    /\ st \in [Oids -> RequestStates \cup {"NONE"}]
    /\ waiter \in [Oids -> BOOLEAN]
    /\ held \in [Oids -> {"none", "output", "failure", "delivered"}]
    /\ dropped \in [Oids -> BOOLEAN]
    /\ mustFire \in [Oids -> SUBSET RequestEvents]
    /\ seen \in [Oids -> SUBSET {"cd", "out"}]
    /\ finished \in [Oids -> BOOLEAN]
    /\ expect \in [Oids -> SUBSET {"cd", "out"}]
    /\ wst \in [Oids -> RequestStates \cup {"NONE"}]
    /\ cdPending \subseteq Oids /\ outPending \in BOOLEAN /\ msgPayload \in BOOLEAN
    /\ rpc \in [Rpcs -> {"none", "pending", "done"}]
    /\ rranks \in [Rpcs -> SUBSET Ranks]
    /\ ans \in [Rpcs -> [Ranks -> {"none", "ok", "failed"}]]
    /\ cdRank \in [Rpcs -> Ranks \cup {-1}]
    /\ announced \in [Rpcs -> SUBSET Oids]
    /\ closed \in BOOLEAN

\* The state at the start of every trace (everything but i).
NoneSt == [o \in Oids |-> "NONE"]
NoWaiter == [o \in Oids |-> FALSE]
NoHeld == [o \in Oids |-> "none"]
NoFire == [o \in Oids |-> NoEvents]
NoSeen == [o \in Oids |-> {}]
NoRpc == [k \in Rpcs |-> "none"]
NoRanks == [k \in Rpcs |-> {}]
NoAnswers == [k \in Rpcs |-> [r \in Ranks |-> "none"]]
NoCdRank == [k \in Rpcs |-> -1]
Fresh ==
    /\ st = NoneSt /\ waiter = NoWaiter /\ held = NoHeld /\ dropped = NoWaiter
    /\ mustFire = NoFire /\ seen = NoSeen /\ finished = NoWaiter /\ expect = NoSeen
    /\ wst = NoneSt /\ msg = NoMsg
    /\ cdPending = {} /\ outPending = FALSE /\ msgPayload = FALSE
    /\ rpc = NoRpc /\ rranks = NoRanks /\ ans = NoAnswers /\ cdRank = NoCdRank
    /\ announced = NoRanks /\ closed = FALSE

\* The same, for the next state (TLC cannot assign through a primed definition).
FreshNext ==
    /\ st' = NoneSt /\ waiter' = NoWaiter /\ held' = NoHeld /\ dropped' = NoWaiter
    /\ mustFire' = NoFire /\ seen' = NoSeen /\ finished' = NoWaiter /\ expect' = NoSeen
    /\ wst' = NoneSt /\ msg' = NoMsg
    /\ cdPending' = {} /\ outPending' = FALSE /\ msgPayload' = FALSE
    /\ rpc' = NoRpc /\ rranks' = NoRanks /\ ans' = NoAnswers /\ cdRank' = NoCdRank
    /\ announced' = NoRanks /\ closed' = FALSE

Init == i = 0 /\ Fresh

Ev == TraceLog[i + 1]
Is(action) == i < Len(TraceLog) /\ Ev.a = action
Step == i' = i + 1

\* A state predicate used as a guard.  Compared with TRUE so that TLC evaluates it
\* as a value: inside an action TLC would unfold a quantifier into one nested
\* conjunct per element (one stack frame each, overflowing with many ids).
Holds(p) == p = TRUE

\* The previous message is fully handled and no record is left half-way:
\* checked before the pump takes the next message and at the end of a trace.
Settled ==
    /\ cdPending = {} \/ closed
    /\ ~outPending \/ closed
    /\ ~msgPayload
    /\ \A o \in Oids :
          /\ mustFire[o] = NoEvents
          /\ st[o] \notin RequestTerminal
          /\ held[o] \in {"output", "failure"} => st[o] \in RequestHolding
          /\ held[o] # "delivered"

-----------------------------------------------------------------------------
(* Executor-side events: Dispatcher.handle and OutputRegistry.            *)

\* A late message of an id that already finished, which its tombstone expects
\* (OutputRegistry._late_message): swallowed without a trace event.
LateCd(o) == st[o] = "NONE" /\ finished[o] /\ "cd" \in expect[o]
LateOut(o) == st[o] = "NONE" /\ finished[o] /\ "out" \in expect[o]

\* The pump dequeued a message (PumpRecvComputeDone / PumpRecvOutputReady /
\* PumpRecvRpcResult).  A traced worker must have reached the state in which
\* it sends that message.
TracePumpRecv ==
    /\ Is("PumpRecv") /\ Holds(Settled)
    /\ Ev.x \in {"COMPUTE_DONE", "OUTPUT_READY", "RPC_RESULT"}
    /\ Holds(Ev.x = "COMPUTE_DONE" => \A o \in Ev.ids : wst[o] \notin {"QUEUED", "COMPUTING"})
    /\ Ev.x = "OUTPUT_READY" =>
          wst[Ev.o] \in {"NONE", "PACKING", "READY", "FAILED", "DROPPING", "DROPPED"}
    /\ msg' = [kind |-> Ev.x, o |-> Ev.o, ok |-> Ev.ok, k |-> Ev.k, r |-> Ev.r, ids |-> Ev.ids]
    /\ IF Ev.x = "COMPUTE_DONE"
       THEN /\ cdPending' = {o \in Ev.ids : ~LateCd(o)}
            /\ expect' = [o \in Oids |-> IF o \in Ev.ids /\ LateCd(o) THEN expect[o] \ {"cd"} ELSE expect[o]]
            /\ outPending' = FALSE
       ELSE IF Ev.x = "OUTPUT_READY" /\ LateOut(Ev.o)
       THEN /\ expect' = [expect EXCEPT ![Ev.o] = @ \ {"out"}]
            /\ cdPending' = {} /\ outPending' = FALSE
       ELSE /\ cdPending' = {} /\ outPending' = (Ev.x = "OUTPUT_READY")
            /\ UNCHANGED expect
    /\ msgPayload' = (Ev.x = "OUTPUT_READY" /\ Ev.ok)
    \* what the registry accepts of it (refused ids are taken out below)
    /\ announced' = IF Ev.x = "COMPUTE_DONE" /\ Ev.k \in Rpcs /\ rpc[Ev.k] = "pending"
                    THEN [announced EXCEPT ![Ev.k] = {o \in Ev.ids : ~LateCd(o)}] ELSE announced
    /\ Step
    /\ UNCHANGED <<st, waiter, held, dropped, mustFire, seen, finished, wst, rpc, rranks, ans, cdRank, closed>>

\* _get_or_create: only for an id the current message names, never when closed.
TraceCreate ==
    /\ Is("Create") /\ ~closed
    /\ st[Ev.o] = "NONE" /\ ~finished[Ev.o]
    /\ Ev.o \in cdPending \/ (outPending /\ msg.o = Ev.o)
    /\ st' = [st EXCEPT ![Ev.o] = RegistryInitial]
    /\ waiter' = [waiter EXCEPT ![Ev.o] = FALSE]
    /\ held' = [held EXCEPT ![Ev.o] = "none"]
    /\ seen' = [seen EXCEPT ![Ev.o] = {}]
    /\ Step
    /\ UNCHANGED <<dropped, mustFire, finished, expect, wst, msg, cdPending, outPending, msgPayload,
                   rpc, rranks, ans, cdRank, announced, closed>>

\* Why the event may fire now, besides the table.
Justified(o, e) ==
    CASE e = "COMPUTE_DONE" -> o \in cdPending
      [] e \in {"OUTPUT_READY", "OUTPUT_FAILED"} ->
            outPending /\ msg.o = o /\ (e = "OUTPUT_READY") = msg.ok
      [] e = "DELIVER" -> waiter[o]
      [] e \in {"DROP", "ABANDON", "FORCE_RELEASE"} -> ~waiter[o]
      [] OTHER -> FALSE

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
    /\ Step
    /\ UNCHANGED <<waiter, finished, expect, wst, msg, rpc, rranks, ans, cdRank, announced, closed>>

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
    /\ UNCHANGED <<waiter, held, dropped, mustFire, seen, wst, msg, cdPending, outPending, msgPayload,
                   rpc, rranks, ans, cdRank, announced, closed>>

\* wait: a live record that is still wanted gets one waiter.
TraceWaiterAdd ==
    /\ Is("WaiterAdd") /\ ~closed
    /\ st[Ev.o] \notin {"NONE", "DROPPING", "DROPPING_EARLY", "RELEASING", "RELEASING_EARLY"}
    /\ ~waiter[Ev.o]
    /\ waiter' = [waiter EXCEPT ![Ev.o] = TRUE]
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, held, dropped, mustFire, wst, msg, cdPending, outPending, msgPayload,
                   rpc, rranks, ans, cdRank, announced, closed>>

\* The event the record must take after its waiter failed with this outcome.
FailFire(outcome) ==
    CASE outcome = "dropped" -> {"DROP", "ABANDON"}
      [] outcome = "timeout" -> {"ABANDON"}
      [] outcome \in {"shutdown", "worker_died"} -> {"FORCE_RELEASE"}
      [] outcome = "cancelled" -> {"DROP", "ABANDON", "FORCE_RELEASE"}
      [] OTHER -> {}

\* A waiter is resolved once: with the output it was delivered, with the
\* failure the record held, or with an error after which the record moves on.
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
         \* an error; "cancelled" also when the claim found the Future cancelled (F3)
         [] Ev.x \in {"dropped", "timeout", "shutdown", "worker_died", "cancelled"} ->
              /\ mustFire' = [mustFire EXCEPT ![Ev.o] = FailFire(Ev.x)]
              /\ UNCHANGED held
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, dropped, wst, msg, cdPending, outPending, msgPayload,
                   rpc, rranks, ans, cdRank, announced, closed>>

\* The delivered output goes to the waiter; never after a drop.
TracePayloadDeliver ==
    /\ Is("PayloadDeliver")
    /\ st[Ev.o] = "DELIVERED" /\ held[Ev.o] = "output" /\ ~dropped[Ev.o]
    /\ held' = [held EXCEPT ![Ev.o] = "delivered"]
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, waiter, dropped, mustFire, wst, msg, cdPending, outPending, msgPayload,
                   rpc, rranks, ans, cdRank, announced, closed>>

\* A payload is released once: the one a record held (it left a holding
\* state), or the one the current message brought when nobody may have it
\* (the id's record ended on arrival, the message was a duplicate, or the
\* registry is closed).
TracePayloadRelease ==
    /\ Is("PayloadRelease")
    /\ IF held[Ev.o] = "output" /\ st[Ev.o] \notin RequestHolding
       THEN /\ held' = [held EXCEPT ![Ev.o] = "none"]
            /\ UNCHANGED <<msgPayload, outPending>>
       ELSE /\ msgPayload /\ msg.o = Ev.o
            \* handled: ended on arrival, refused as a duplicate, or late; or the registry is closed
            /\ ~outPending \/ (closed /\ st[Ev.o] = "NONE")
            /\ msgPayload' = FALSE
            /\ outPending' = FALSE
            /\ UNCHANGED held
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, waiter, dropped, mustFire, wst, msg, cdPending,
                   rpc, rranks, ans, cdRank, announced, closed>>

\* A message the table does not allow is refused, and the state stays.
TraceProtocolError ==
    /\ Is("ProtocolError")
    /\ msg # NoMsg
    /\ IF Ev.o = 0
       THEN UNCHANGED <<cdPending, outPending, announced>>  \* the dispatcher's (wrong rank, duplicate answer)
       ELSE /\ st[Ev.o] # "NONE" \/ finished[Ev.o]   \* else the registry creates a record
            /\ \/ /\ Ev.o \in cdPending /\ st[Ev.o] \notin RequestAwaitingComputeDone
                  /\ cdPending' = cdPending \ {Ev.o}
                  \* a refused id belongs to another call: not announced by this one
                  /\ announced' = IF msg.k \in Rpcs THEN [announced EXCEPT ![msg.k] = @ \ {Ev.o}] ELSE announced
                  /\ UNCHANGED outPending
               \/ /\ outPending /\ msg.o = Ev.o
                  /\ ~RequestCan(st[Ev.o], IF msg.ok THEN "OUTPUT_READY" ELSE "OUTPUT_FAILED")
                  /\ outPending' = FALSE
                  /\ UNCHANGED <<cdPending, announced>>
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, waiter, held, dropped, mustFire, wst, msg, msgPayload,
                   rpc, rranks, ans, cdRank, closed>>

-----------------------------------------------------------------------------
(* RPC events: Dispatcher (F12). *)

TraceRpcSubmit ==
    /\ Is("RpcSubmit") /\ rpc[Ev.k] = "none" /\ Ev.rk # {}
    /\ rpc' = [rpc EXCEPT ![Ev.k] = "pending"]
    /\ rranks' = [rranks EXCEPT ![Ev.k] = Ev.rk]
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, waiter, held, dropped, mustFire, wst, msg, cdPending, outPending, msgPayload,
                   ans, cdRank, announced, closed>>

\* One answer per rank, from the message being handled (a COMPUTE_DONE from
\* a rank that may not send one is turned into a failure).
TraceRpcAnswer ==
    /\ Is("RpcAnswer")
    /\ rpc[Ev.k] = "pending" /\ Ev.r \in rranks[Ev.k] /\ ans[Ev.k][Ev.r] = "none"
    /\ msg.k = Ev.k /\ msg.r = Ev.r /\ msg.kind \in {"COMPUTE_DONE", "RPC_RESULT"}
    /\ Ev.ok = msg.ok \/ (msg.kind = "COMPUTE_DONE" /\ ~Ev.ok)
    /\ ans' = [ans EXCEPT ![Ev.k][Ev.r] = IF Ev.ok THEN "ok" ELSE "failed"]
    /\ cdRank' = IF msg.kind = "COMPUTE_DONE" /\ Ev.ok THEN [cdRank EXCEPT ![Ev.k] = Ev.r] ELSE cdRank
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, waiter, held, dropped, mustFire, wst, msg, cdPending, outPending, msgPayload,
                   rpc, rranks, announced, closed>>

AllAnswered(k) == \A r \in rranks[k] : ans[k][r] # "none"

\* An RPC resolves as success only when every rank answered and none failed
\* (F12), and every id it announced has been registered; otherwise what it
\* announced has been dropped.
ResolveAllowed(k, outcome) ==
    CASE outcome = "ok" ->
              /\ AllAnswered(k) /\ \A r \in rranks[k] : ans[k][r] = "ok"
              /\ cdRank[k] # -1
              \* registered before the call resolves (ended already only if abandoned,
              \* e.g. by release_consumer while the call was pending)
              /\ \A o \in announced[k] :
                    IF st[o] = "NONE" THEN finished[o] ELSE st[o] \notin RequestAwaitingComputeDone
      [] outcome \in {"failed", "cancelled"} ->
              /\ AllAnswered(k)
              /\ outcome = "failed" => (\E r \in rranks[k] : ans[k][r] = "failed") \/ cdRank[k] = -1
              /\ \A o \in announced[k] : st[o] \in {"NONE", "DROPPING", "DROPPING_EARLY"}
      [] outcome = "timeout" ->
              \A o \in announced[k] : st[o] \in {"NONE", "DROPPING", "DROPPING_EARLY"}
      [] outcome \in {"shutdown", "worker_died"} -> TRUE
      \* release_consumer fails the consumer's pending calls: whatever they announce
      \* later is an orphan and dropped on arrival.
      [] outcome = "consumer_gone" -> TRUE
      [] OTHER -> FALSE

TraceRpcResolve ==
    /\ Is("RpcResolve") /\ rpc[Ev.k] = "pending"
    /\ Holds(ResolveAllowed(Ev.k, Ev.x))
    /\ rpc' = [rpc EXCEPT ![Ev.k] = "done"]
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, waiter, held, dropped, mustFire, wst, msg, cdPending, outPending, msgPayload,
                   rranks, ans, cdRank, announced, closed>>

\* fail_all(close=True): nothing is created afterwards; every record is
\* force-released (checked at the end of the trace: the registry is empty).
\* Idempotent: a repeated shutdown changes nothing.
TraceShutdown ==
    /\ Is("Shutdown")
    /\ closed' = TRUE
    /\ Step
    /\ UNCHANGED <<st, seen, finished, expect, waiter, held, dropped, mustFire, wst, msg, cdPending, outPending, msgPayload,
                   rpc, rranks, ans, cdRank, announced>>

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
    /\ UNCHANGED <<st, seen, finished, expect, waiter, held, dropped, mustFire, msg, cdPending, outPending, msgPayload,
                   rpc, rranks, ans, cdRank, announced, closed>>

-----------------------------------------------------------------------------
(* Trace boundaries. *)

\* The end of one trace: everything settled; after a shutdown nothing is
\* left: no record, no waiter, no pending RPC.  Then the next trace starts fresh.
TraceEnd ==
    /\ Is("End") /\ Holds(Settled)
    /\ Holds(closed => /\ \A o \in Oids : st[o] = "NONE" /\ ~waiter[o]
                      /\ \A k \in Rpcs : rpc[k] # "pending")
    /\ Step
    /\ FreshNext

Done == i = Len(TraceLog) /\ UNCHANGED vars

Next ==
    \/ TracePumpRecv
    \/ TraceCreate
    \/ TraceFire
    \/ TraceRemove
    \/ TraceWaiterAdd
    \/ TraceWaiterResolve
    \/ TracePayloadDeliver
    \/ TracePayloadRelease
    \/ TraceProtocolError
    \/ TraceRpcSubmit
    \/ TraceRpcAnswer
    \/ TraceRpcResolve
    \/ TraceShutdown
    \/ TraceWorkerFire
    \/ TraceEnd
    \/ Done

Spec == Init /\ [][Next]_vars

=============================================================================
