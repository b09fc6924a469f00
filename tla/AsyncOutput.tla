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
(*     output into a leased shared-memory segment, hands the lease off     *)
(*     (SegmentPool.hand_off: it is "shipped"), sends OUTPUT_READY (or     *)
(*     OUTPUT_READY carrying a failure);                                   *)
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
(*   - the monitor: notices a dead worker; the pump reads the dead         *)
(*     worker's pipe to its end, then what it shipped and never sent is    *)
(*     reclaimed;                                                          *)
(*   - the control channel: the executor cancels the forward of a call in  *)
(*     flight (cancel_requests, or its compute deadline); a worker-side    *)
(*     thread hears it while the main thread may be in the forward.  The   *)
(*     worker then never starts that forward, or stops it and answers with *)
(*     an aborted failure, or (the cancel came too late) finishes anyway,  *)
(*     and the executor drops the ids it announced on arrival;             *)
(*   - streaming: while the forward of a streaming call runs, the reply    *)
(*     rank's main thread emits its chunks (Chunks[k]) one by one: each is *)
(*     announced with a CHUNK message, then handed to the packer, whose    *)
(*     OUTPUT_READY ships it like any output.  The dispatcher registers a  *)
(*     chunk like a COMPUTE_DONE of its one id and hands it to the engine  *)
(*     (its stream), or drops it when nobody wants it; a chunk never       *)
(*     answers its call.  The engine takes each chunk (a wait) or closes   *)
(*     the stream (what it did not take is dropped, later chunks are       *)
(*     dropped on arrival);                                                *)
(*   - step mode's final-step async: a call in Steps whose forward is an   *)
(*     intermediate step (no output: Batch[k] = <<>>) is answered by the   *)
(*     reply rank with a plain RPC_RESULT, which the dispatcher accepts as *)
(*     success; its final step is an ordinary call.                        *)
(*                                                                         *)
(* Every registry operator below mirrors one method of                     *)
(* omni_async.core.registry.OutputRegistry (see spec/PROTOCOL.md).  This   *)
(* module is the correct protocol only: the failure modes of the reference *)
(* implementation (DESIGN.md, F1-F16) and the bugs TLC found are           *)
(* MCAsyncOutputBugs.tla, each one operator of this module replaced in its *)
(* cfg (buggy/*.cfg), so that TLC can show what each one breaks.           *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, RequestTable

CONSTANTS
    Ranks,          \* the worker ranks, e.g. {0, 1}
    ReplyRank,      \* the rank that announces and ships outputs
    Batch,          \* Batch[k]: the output ids that execute RPC k produces, in request order
    Chunks,         \* Chunks[k]: the chunk ids RPC k's forward streams, in order (<<>>: not a stream)
    Steps,          \* the RPCs that are steps of step mode (final-step async)
    Consumer,       \* Consumer[k]: the consumer of execute RPC k (NoConsumer: none)
    MaxCrashes,     \* how many workers may crash (0 or 1)
    ForwardFails,   \* BOOLEAN: a rank's forward may fail
    PackFails,      \* BOOLEAN: packing may fail
    SendFails,      \* BOOLEAN: the reply rank's put of COMPUTE_DONE may raise
    EngineAborts,   \* BOOLEAN: the engine may cancel, drop, time out and shut down
    CancelsForward, \* BOOLEAN: the engine may abort a call in flight (cancel_requests)
    MaxQueue        \* state constraint: messages per rank FIFO

ASSUME ReplyRank \in Ranks

NumRpcs == Len(Batch)
RpcIds == 1..NumRpcs
NoCall == 0
Range(s) == {s[n] : n \in DOMAIN s}
\* The ids of each call (its outputs, its chunks), and the call of each id
\* (constants: TLC computes them once).
BatchIds == [k \in RpcIds |-> Range(Batch[k])]
ChunkIdsOf == [k \in RpcIds |-> Range(Chunks[k])]
ChunkIds(k) == ChunkIdsOf[k]
Ids == UNION {BatchIds[k] \cup ChunkIds(k) : k \in RpcIds}
CallOf == [i \in Ids |-> CHOOSE k \in RpcIds : i \in BatchIds[k] \cup ChunkIds(k)]
RpcOf(i) == CallOf[i]
IsChunk(i) == i \in ChunkIds(RpcOf(i))
NoId == "-"
NoConsumer == ""
Consumers == Range(Consumer) \ {NoConsumer}

\* What the engine knows about an output id.
EngineViews == {"none", "known", "waiting", "holding", "done"}
\* The registry's waiter slot: "cancelled" = the Future was cancelled, the
\* done-callback that tells the registry has not run yet.
WaiterSlots == {"none", "waiting", "cancelled"}
\* The id's segment, as the pool's table says: "leased" by the packer (not
\* handed off yet) or, once its OUTPUT_READY was read, by the executor;
\* "shipped": handed off by the packer, its message not read yet (the table's
\* owner -pid); "consumer": delivered to the engine.
SegStates == {"none", "leased", "shipped", "consumer", "released"}
\* "cancelling": the engine cancelled the call's Future, the dispatcher still
\* waits for its answers; "gone": its consumer went away.
\* "unsent": its broadcast failed part-way (Dispatcher.forget).
\* "aborted": the engine aborted it (cancel_requests) and every rank answered.
RpcStates == {"idle", "pending", "cancelling", "ok", "failed", "cancelled", "timeout", "shutdown", "gone", "unsent",
              "aborted"}
\* "shipped": a failed answer that names the ids the rank had already handed
\* to its packer (the failure that replaces a COMPUTE_DONE whose put raised).
\* "step": the reply rank's plain answer of an intermediate step (a call in Steps).
Answers == {"none", "ok", "failed", "shipped", "step"}

\* ids: the output ids the message names (async_output_ids): a COMPUTE_DONE's,
\* or those of the failure that replaces a COMPUTE_DONE whose put raised.
\* rpc: the call it answers; NoCall for an OUTPUT_READY, and for a COMPUTE_DONE,
\* CHUNK or RPC_RESULT of a call this executor never made (a faulty peer's: the
\* model's workers answer only the calls submitted; trace validation feeds
\* the pump such messages as the implementation recorded them).
Msg == [kind : {"COMPUTE_DONE", "OUTPUT_READY", "RPC_RESULT", "CHUNK"},
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
        ghost : BOOLEAN,                        \* a COMPUTE_DONE of a call never made announced it (M6)
        late : SUBSET {"fin", "cd", "out"}]     \* tombstone: "fin" once removed, and the messages still expected

VARIABLES
    alive,        \* [Ranks -> BOOLEAN]
    mainPc,       \* [Ranks -> {"idle", "sendOk", "sendFail", "sendAborted"}]: after a forward, before its answer
    mainRpc,      \* [Ranks -> 0..NumRpcs]: the last RPC the main thread took
    failedRanks,  \* history: [RpcIds -> SUBSET Ranks], ranks whose forward (or COMPUTE_DONE put) failed
    ws,           \* [Ids -> RequestStates]: the worker's machine of each id (reply rank)
    packQ,        \* the packer's queue of ids
    packing,      \* the id the packer is copying, or NoId
    chan,         \* [Ranks -> Seq(Msg)]: the result channel
    sent, recvd,  \* history: messages put / taken per rank
    eof,          \* the dead ranks whose pipe the pump read to its end (PumpReachEof)
    crashes,      \* workers crashed so far
    pump,         \* the pump's lifecycle state (LifecycleTable)
    closed,       \* the registry is closed (shutdown)
    dead,         \* the executor saw a worker die
    submitted,    \* execute RPCs the engine has submitted, 1..submitted
    rpcs,         \* [RpcIds -> RpcStates]: the dispatcher's view of each RPC
    answers,      \* [RpcIds -> [Ranks -> Answers]]
    rec,          \* [Ids -> Rec]
    perr,         \* history: the registry refused a message (a protocol error)
    gone,         \* the consumers that went away (release_consumer)
    abortSent,    \* the calls the executor cancelled on the workers (cancel_requests, compute deadline)
    closedStreams \* the calls whose stream the engine closed (RequestStream.close)

worker == <<alive, mainPc, mainRpc, failedRanks, ws, packQ, packing, crashes>>
channel == <<chan, sent, recvd, eof>>
executor == <<pump, closed, dead, submitted, rpcs, answers, rec, perr, gone, abortSent, closedStreams>>
vars == <<worker, channel, executor>>

-----------------------------------------------------------------------------
TypeOK ==
    /\ alive \in [Ranks -> BOOLEAN]
    /\ mainPc \in [Ranks -> {"idle", "sendOk", "sendFail", "sendAborted"}]
    /\ mainRpc \in [Ranks -> 0..NumRpcs]
    /\ failedRanks \in [RpcIds -> SUBSET Ranks]
    /\ ws \in [Ids -> RequestStates]
    /\ packQ \in Seq(Ids)
    /\ packing \in Ids \cup {NoId}
    /\ chan \in [Ranks -> Seq(Msg)]
    /\ sent \in [Ranks -> Nat] /\ recvd \in [Ranks -> Nat]
    /\ eof \subseteq Ranks
    /\ crashes \in 0..MaxCrashes
    /\ pump \in LifecycleStates
    /\ closed \in BOOLEAN /\ dead \in BOOLEAN
    /\ submitted \in 0..NumRpcs
    /\ rpcs \in [RpcIds -> RpcStates]
    /\ answers \in [RpcIds -> [Ranks -> Answers]]
    /\ rec \in [Ids -> Rec]
    /\ perr \in BOOLEAN
    /\ gone \subseteq Consumers
    /\ abortSent \subseteq RpcIds
    /\ closedStreams \subseteq RpcIds

NoRec == [st |-> "NONE", held |-> NoId, waiter |-> "none", eng |-> "none", seg |-> "none",
          frees |-> 0, nres |-> 0, got |-> NoId, dropped |-> FALSE, gaveUp |-> FALSE, ghost |-> FALSE,
          late |-> {}]

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
    /\ eof = {}
    /\ crashes = 0
    /\ pump = LifecycleNext(LifecycleInitial, "STARTED")
    /\ closed = FALSE /\ dead = FALSE
    /\ submitted = 0
    /\ rpcs = [k \in RpcIds |-> "idle"]
    /\ answers = [k \in RpcIds |-> [r \in Ranks |-> "none"]]
    /\ rec = [i \in Ids |-> NoRec]
    /\ perr = FALSE
    /\ gone = {}
    /\ abortSent = {}
    /\ closedStreams = {}

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

-----------------------------------------------------------------------------
(* Channel helpers. *)

\* put: atomic under the channel's lock, whichever thread puts (F7).
Send(r, m) ==
    /\ sent' = [sent EXCEPT ![r] = @ + 1]
    /\ chan' = [chan EXCEPT ![r] = Append(@, m)]
    /\ UNCHANGED eof

Recv(r) ==
    /\ chan' = [chan EXCEPT ![r] = Tail(@)]
    /\ recvd' = [recvd EXCEPT ![r] = @ + 1]
    /\ UNCHANGED eof

MsgsOf(r) == {chan[r][n] : n \in 1..Len(chan[r])}

-----------------------------------------------------------------------------
(* Worker actions: omni_async.worker.loop.WorkerLoop.handle_rpc and       *)
(* omni_async.worker.packer.Packer._pack_one.                             *)

\* Take the next execute RPC and run the forward.  The reply rank's machines
\* go QUEUED -> COMPUTING -> COMPUTE_DONE and its outputs go to the packer
\* before COMPUTE_DONE is sent, so the packer can answer first.
\* A call the executor cancelled before the forward ended is aborted
\* (WorkerLoop._abort_call): it never starts, or its forward stops at a
\* cancellation check, or it runs to the end and its outputs are discarded;
\* either way nothing goes to the packer and the answer is an aborted failure.
\* The control channel (a pipe read by the rank's omni-cancel thread) is
\* modelled as instantaneous: the worker reads abortSent.  A cancel still in
\* transit when the forward ends is the same, to every other actor, as one
\* sent after it (the worker finishes anyway), which the model has.
WorkerMainForward(r) ==
    /\ alive[r] /\ mainPc[r] = "idle" /\ mainRpc[r] < submitted
    /\ LET k == mainRpc[r] + 1
           ids == BatchIds[k]
       IN /\ mainRpc' = [mainRpc EXCEPT ![r] = k]
          /\ \/ /\ k \in abortSent
                /\ mainPc' = [mainPc EXCEPT ![r] = "sendAborted"]
                /\ IF r = ReplyRank
                   THEN ws' = [i \in Ids |-> IF i \in ids
                                   THEN RequestNext(RequestNext(ws[i], "FORWARD"), "FORCE_RELEASE")
                                   ELSE ws[i]]
                   ELSE UNCHANGED ws
                /\ UNCHANGED <<packQ, failedRanks>>
             \/ /\ k \notin abortSent
                /\ mainPc' = [mainPc EXCEPT ![r] = "sendOk"]
                /\ IF r = ReplyRank
                   THEN /\ ws' = [i \in Ids |-> IF i \in ids
                                      THEN RequestNext(RequestNext(ws[i], "FORWARD"), "COMPUTE_DONE")
                                      ELSE ws[i]]
                        /\ packQ' = packQ \o Batch[k]
                   ELSE UNCHANGED <<ws, packQ>>
                /\ UNCHANGED failedRanks
             \/ /\ ForwardFails /\ k \notin abortSent
                /\ mainPc' = [mainPc EXCEPT ![r] = "sendFail"]
                /\ failedRanks' = [failedRanks EXCEPT ![k] = @ \cup {r}]
                /\ IF r = ReplyRank
                   THEN ws' = [i \in Ids |-> IF i \in ids
                                   THEN RequestNext(RequestNext(ws[i], "FORWARD"), "FORCE_RELEASE")
                                   ELSE ws[i]]
                   ELSE UNCHANGED ws
                /\ UNCHANGED packQ
    /\ UNCHANGED <<alive, packing, crashes, channel, executor>>

\* The chunks of call k the reply rank has not emitted (yet).
Unemitted(k) == {i \in ChunkIds(k) : ws[i] = "QUEUED"}

\* While the forward of a streaming call runs, the reply rank emits its next
\* chunk (WorkerLoop._emit_chunk, called by the model through emit_chunk):
\* room in the packer, the device event, the CHUNK message, then the hand-off
\* to the packer -- so the chunk's OUTPUT_READY can never overtake its CHUNK
\* (one FIFO per rank), and every CHUNK precedes the call's answer.  The model
\* emits between the forward's outcome and its answer: to every other actor
\* that is the same as emitting during the forward.  A forward that fails or
\* is aborted may stop after any prefix of its chunks.
WorkerMainEmitChunk(r) ==
    /\ alive[r] /\ r = ReplyRank /\ mainPc[r] \in {"sendOk", "sendFail", "sendAborted"}
    /\ LET k == mainRpc[r] IN
       \E n \in DOMAIN Chunks[k] :
          /\ ws[Chunks[k][n]] = "QUEUED"
          /\ \A m \in 1..(n - 1) : ws[Chunks[k][m]] # "QUEUED"
          /\ LET i == Chunks[k][n] IN
             /\ ws' = [ws EXCEPT ![i] = RequestNext(RequestNext(@, "FORWARD"), "COMPUTE_DONE")]
             /\ Send(r, [kind |-> "CHUNK", rpc |-> k, id |-> i, ok |-> TRUE, out |-> NoId, w |-> "main",
                         ids |-> {}])
             /\ packQ' = Append(packQ, i)
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packing, crashes, recvd, executor>>

\* A successful forward emitted every chunk before its answer.
WorkerMainSendComputeDone(r) ==
    /\ alive[r] /\ r = ReplyRank /\ mainPc[r] = "sendOk"
    /\ Batch[mainRpc[r]] # <<>> /\ Unemitted(mainRpc[r]) = {}
    /\ Send(r, [kind |-> "COMPUTE_DONE", rpc |-> mainRpc[r], id |-> NoId, ok |-> TRUE,
                out |-> NoId, w |-> "main", ids |-> BatchIds[mainRpc[r]]])
    /\ mainPc' = [mainPc EXCEPT ![r] = "idle"]
    /\ UNCHANGED <<alive, mainRpc, failedRanks, ws, packQ, packing, crashes, recvd, executor>>

\* The put of COMPUTE_DONE raises (unpicklable, oversize, a full channel) after
\* the outputs went to the packer, whose OUTPUT_READY will come all the same.
\* WorkerLoop._execute_async answers the call with a failure instead, naming
\* the ids it handed to the packer, so that the dispatcher registers and drops
\* them like a failed call's announced ids (Dispatcher.handle).  The failure
\* takes the COMPUTE_DONE's place in the rank's FIFO: every order the registry
\* sees is one it already handles (SendFailKeepsShipped: a failure that
\* names nothing leaves an output that arrives held for nobody).
WorkerMainComputeDoneFails(r) ==
    /\ SendFails /\ alive[r] /\ r = ReplyRank /\ mainPc[r] = "sendOk"
    /\ Batch[mainRpc[r]] # <<>> /\ Unemitted(mainRpc[r]) = {}
    /\ failedRanks' = [failedRanks EXCEPT ![mainRpc[r]] = @ \cup {r}]
    /\ Send(r, [kind |-> "RPC_RESULT", rpc |-> mainRpc[r], id |-> NoId, ok |-> FALSE,
                out |-> NoId, w |-> "main",
                ids |-> BatchIds[mainRpc[r]]])
    /\ mainPc' = [mainPc EXCEPT ![r] = "idle"]
    /\ UNCHANGED <<alive, mainRpc, ws, packQ, packing, crashes, recvd, executor>>

\* A failed or aborted forward (any rank), a non-reply rank's empty result,
\* or the reply rank's answer of an intermediate step (a call in Steps whose
\* forward returned no output).  The chunks a failed or aborted forward did
\* not emit never will be.
WorkerMainSendRpcResult(r) ==
    /\ alive[r]
    /\ \/ mainPc[r] \in {"sendFail", "sendAborted"}
       \/ mainPc[r] = "sendOk" /\ r # ReplyRank
       \/ mainPc[r] = "sendOk" /\ Batch[mainRpc[r]] = <<>> /\ mainRpc[r] \in Steps /\ Unemitted(mainRpc[r]) = {}
    /\ Send(r, [kind |-> "RPC_RESULT", rpc |-> mainRpc[r], id |-> NoId, ok |-> mainPc[r] = "sendOk",
                out |-> NoId, w |-> "main", ids |-> {}])
    /\ mainPc' = [mainPc EXCEPT ![r] = "idle"]
    /\ ws' = IF r = ReplyRank
             THEN [i \in Ids |-> IF i \in Unemitted(mainRpc[r]) THEN RequestNext(ws[i], "FORCE_RELEASE") ELSE ws[i]]
             ELSE ws
    /\ UNCHANGED <<alive, mainRpc, failedRanks, packQ, packing, crashes, recvd, executor>>

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
                   submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

\* The copy is done: the lease is handed off (SegmentPool.hand_off, at the end
\* of pack_diffusion_output_shm), right before the message is put.  From here
\* the dead worker's reclaim_owner spares it (its message may be in the pipe,
\* ReclaimShipped); a crash between this step and the send leaves it shipped
\* with no message: PumpReachEof reclaims it.
PackerHandOff ==
    /\ alive[ReplyRank] /\ packing # NoId /\ rec[packing].seg = "leased"
    /\ rec' = [rec EXCEPT ![packing].seg = "shipped"]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

PackerSendOutputReady ==
    /\ alive[ReplyRank] /\ packing # NoId /\ rec[packing].seg = "shipped"
    /\ ws' = [ws EXCEPT ![packing] = RequestNext(@, "OUTPUT_READY")]
    /\ Send(ReplyRank, [kind |-> "OUTPUT_READY", rpc |-> 0, id |-> packing, ok |-> TRUE,
                        out |-> packing, w |-> "packer", ids |-> {}])
    /\ packing' = NoId
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packQ, crashes, recvd, executor>>

\* Packing failed (or, after the hand-off, the put of OUTPUT_READY raised): the
\* segment goes back, the failure travels typed (F2).
PackerSendOutputFailed ==
    /\ PackFails
    /\ alive[ReplyRank] /\ packing # NoId
    /\ ws' = [ws EXCEPT ![packing] = RequestNext(@, "OUTPUT_FAILED")]
    /\ rec' = [rec EXCEPT ![packing] = ReleaseSeg(@)]
    /\ Send(ReplyRank, [kind |-> "OUTPUT_READY", rpc |-> 0, id |-> packing, ok |-> FALSE,
                        out |-> NoId, w |-> "packer", ids |-> {}])
    /\ packing' = NoId
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packQ, crashes, recvd,
                   pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

\* F15: the engine dropped the output before packing started; the drop reached
\* the packer (Packer.drop), which sends a "Cancelled" failure instead.  Only
\* for an output the engine dropped (PackerCancelsUndropped: NoSpuriousFailure).
PackerCancelOutput ==
    /\ alive[ReplyRank] /\ packing = NoId /\ packQ # <<>>
    /\ LET i == Head(packQ) IN
       /\ rec[i].dropped /\ rec[i].eng = "done"
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
Announced(k) == IF answers[k][ReplyRank] \in {"ok", "shipped"} THEN BatchIds[k] ELSE {}

\* The dispatcher still waits for RPC k's answers (its Future may be cancelled).
Pending(k) == rpcs[k] \in {"pending", "cancelling"}

\* Dispatcher._answer / _complete: the call resolves once every rank answered
\* (ansk), whichever rank r answered last (F12).
Complete(k, ansk, r) == \A q \in Ranks : ansk[q] # "none"

\* Dispatcher._complete: a call that resolves as a failure, whose Future the
\* engine cancelled (the claim fails: CancelKeepsOutputs), or that the engine
\* aborted (_complete_aborted, also when the forward finished anyway:
\* AbortKeepsFinished) drops what its reply rank announced (_drop_all).
DropsAnnounced(fail, cancelled, aborted) == fail \/ cancelled \/ aborted

\* A chunk the engine learned of and has not taken is dropped for it: its
\* call ended badly, or the engine closed the stream (Dispatcher._end_streams,
\* close_stream).  A chunk it took (waiting, holding) stays its own.
DropKnown(x) == IF x.eng = "known" THEN [Drop(x) EXCEPT !.eng = "done"] ELSE x

\* Dispatcher._answer and _complete: record rank r's answer a ("ok",
\* "failed", or "shipped": a failure that names the ids the rank shipped) to
\* pending RPC k, which r has not answered yet; once complete, resolve it:
\* the engine learns what the reply rank announced, or (any failure, or the
\* engine cancelled the call) that is dropped.  x: rec after the registry
\* part of the message.
Answer(k, r, a, x) ==
    LET ansk == [answers[k] EXCEPT ![r] = a]
        done == Complete(k, ansk, r)
        fail == \E q \in Ranks : ansk[q] \in {"failed", "shipped"}
        cancelled == rpcs[k] = "cancelling"
        \* The engine aborted the call (cancel_requests): Dispatcher._complete_aborted.
        aborted == k \in abortSent
        ann == IF ansk[ReplyRank] \in {"ok", "shipped"} THEN BatchIds[k] ELSE {}
        lose == done /\ DropsAnnounced(fail, cancelled, aborted)
    IN /\ answers' = [answers EXCEPT ![k] = ansk]
       /\ rpcs' = IF done
                  THEN [rpcs EXCEPT ![k] = IF aborted THEN "aborted" ELSE IF fail THEN "failed"
                                          ELSE IF cancelled THEN "cancelled" ELSE "ok"]
                  ELSE rpcs
       /\ rec' = [i \in Ids |->
                    IF i \in ChunkIds(k)
                    THEN IF done /\ (fail \/ cancelled \/ aborted) THEN DropKnown(x[i]) ELSE x[i]
                    ELSE IF i \notin ann THEN x[i]
                    ELSE IF lose THEN Drop(x[i])
                    ELSE IF done /\ ~cancelled /\ ~aborted THEN [x[i] EXCEPT !.eng = "known"]
                    ELSE x[i]]

\* A message that names output ids: a COMPUTE_DONE, or the failure that
\* replaces one (Dispatcher.handle registers its ids the same way).
Names(m) == m.ids # {}

\* Dispatcher.handle of message m from rank r: the whole step of the pump,
\* whatever the message (the model's workers send only what the protocol
\* allows; trace validation also feeds it what a faulty peer might send).
\* Defines rec', rpcs', answers', perr'.
\*
\* A message that names ids: the registry takes each id (on_compute_done),
\* then the dispatcher: a call never made is a protocol error, and what the
\* registry accepted is dropped and marked (its expiry gives it up: no worker
\* packs it, M6); a call that is not pending any more (an orphan) drops what
\* the registry accepted; one whose answer is not the reply rank's first, or
\* names an id the registry refused, drops what it accepted and counts as a
\* failed answer (a protocol error); otherwise it is the reply rank's answer,
\* ok or "shipped".
HandleNamed(r, m) ==
    LET k == m.rpc
        x == [i \in Ids |-> IF i \in m.ids THEN OnComputeDone(rec[i]) ELSE rec[i]]
        acc == {i \in m.ids : CdAccepted(rec[i])}
        dropAcc == [i \in Ids |-> IF i \in acc THEN Drop(x[i]) ELSE x[i]]
        answered == r \notin Ranks \/ answers[k][r] # "none"
        wrong == r # ReplyRank \/ answered \/ acc # m.ids
    IN IF k = NoCall
       THEN /\ perr' = TRUE
            /\ rec' = [i \in Ids |-> IF i \in acc THEN [dropAcc[i] EXCEPT !.ghost = TRUE] ELSE dropAcc[i]]
            /\ UNCHANGED <<rpcs, answers>>
       ELSE /\ perr' = (perr \/ (\E i \in m.ids : CdRefused(rec[i])) \/ (Pending(k) /\ wrong))
            /\ IF ~Pending(k) THEN rec' = dropAcc /\ UNCHANGED <<rpcs, answers>>
               ELSE IF wrong /\ answered THEN rec' = dropAcc /\ UNCHANGED <<rpcs, answers>>
               ELSE IF wrong THEN Answer(k, r, "failed", dropAcc)
               ELSE Answer(k, r, IF m.ok THEN "ok" ELSE "shipped", x)

\* A plain RPC_RESULT: one of a call never made is a protocol error, and
\* discarded; an answer of a call that ended goes to the synchronous buffer,
\* unread (it drops nothing: the call's end disposed of its ids); a second
\* answer of a rank is a protocol error; the reply rank answering without
\* COMPUTE_DONE is one too, and fails the call.
HandlePlain(r, m) ==
    LET k == m.rpc IN
    IF k = NoCall THEN perr' = TRUE /\ UNCHANGED <<rec, rpcs, answers>>
    ELSE IF ~Pending(k) THEN UNCHANGED <<rec, rpcs, answers, perr>>
    ELSE IF r \notin Ranks \/ answers[k][r] # "none" THEN perr' = TRUE /\ UNCHANGED <<rec, rpcs, answers>>
    ELSE /\ Answer(k, r, CASE ~m.ok -> "failed"
                           [] r # ReplyRank -> "ok"
                           [] k \in Steps -> "step"
                           [] OTHER -> "failed", rec)
         /\ perr' = (perr \/ (m.ok /\ r = ReplyRank /\ k \notin Steps))

\* An OUTPUT_READY (on_output), on the records x.
HandleOutputIn(x, m) ==
    /\ rec' = [x EXCEPT ![m.id] = OnOutput(@, m.ok, m.out)]
    /\ perr' = (perr \/ OutRefused(x[m.id], m.ok))
    /\ UNCHANGED <<rpcs, answers>>

\* The engine wants chunk of call k from rank r: its call is pending, its
\* Future not cancelled, it was not aborted, its stream not closed and the
\* chunk is the reply rank's.
ChunkWanted(r, k) == rpcs[k] = "pending" /\ k \notin abortSent /\ k \notin closedStreams /\ r = ReplyRank

\* The record of chunk i of call k once rank r's CHUNK is registered: the
\* engine learns of a chunk it wants; any other is dropped on arrival (an
\* orphan, unwanted, or a protocol error: another rank's).  ChunkOrphanKept:
\* a chunk of a call that ended kept instead.
ChunkArrives(r, k, i) ==
    LET x == OnComputeDone(rec[i]) IN
    IF ~CdAccepted(rec[i]) THEN x
    ELSE IF ChunkWanted(r, k) THEN [x EXCEPT !.eng = "known"]
    ELSE [Drop(x) EXCEPT !.eng = "done"]

\* A CHUNK (Dispatcher._on_chunk): the registry takes its id like a
\* COMPUTE_DONE's, and the engine learns of it or it is dropped
\* (ChunkArrives).  A chunk never answers its call (ChunkResolvesCall).
\* A chunk of a call never made is a protocol error: dropped and marked, like
\* the ids of such a COMPUTE_DONE (HandleNamed).
HandleChunk(r, m) ==
    LET k == m.rpc
        i == m.id
        x == OnComputeDone(rec[i])
    IN IF k = NoCall
       THEN /\ perr' = TRUE
            /\ rec' = [rec EXCEPT ![i] = IF CdAccepted(rec[i]) THEN [Drop(x) EXCEPT !.ghost = TRUE] ELSE x]
            /\ UNCHANGED <<rpcs, answers>>
       ELSE /\ perr' = (perr \/ CdRefused(rec[i]) \/ (Pending(k) /\ r # ReplyRank))
            /\ rec' = [rec EXCEPT ![i] = ChunkArrives(r, k, i)]
            /\ UNCHANGED <<rpcs, answers>>

HandleOutput(m) == HandleOutputIn(rec, m)

\* The pump read a message carrying the segment of out: the executor marks the
\* lease received (SegmentPool.receive, in the executor's _ReceivingEnd), before
\* the dispatcher sees the message.
Received(x, out) == [i \in Ids |-> IF i = out /\ x[i].seg = "shipped" THEN [x[i] EXCEPT !.seg = "leased"] ELSE x[i]]

Handle(r, m) ==
    CASE m.kind = "CHUNK"        -> HandleChunk(r, m)
      [] m.kind = "OUTPUT_READY" -> HandleOutput(m)
      [] Names(m)                -> HandleNamed(r, m)
      [] OTHER                   -> HandlePlain(r, m)

PumpRecvComputeDone(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Names(Head(chan[r]))
    /\ HandleNamed(r, Head(chan[r]))
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, pump, closed, dead, submitted, gone, abortSent, closedStreams>>

PumpRecvChunk(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Head(chan[r]).kind = "CHUNK"
    /\ HandleChunk(r, Head(chan[r]))
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, pump, closed, dead, submitted, gone, abortSent, closedStreams>>

PumpRecvRpcResult(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Head(chan[r]).kind = "RPC_RESULT" /\ ~Names(Head(chan[r]))
    /\ HandlePlain(r, Head(chan[r]))
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, pump, closed, dead, submitted, gone, abortSent, closedStreams>>

\* An OUTPUT_READY that finds no record creates one (F6: it is not split by a
\* map registered at COMPUTE_DONE); a waiter whose Future was cancelled
\* between "is it done?" and "set result" is abandoned, never raised into the
\* pump (F3: ClaimFails in AfterChange).
PumpRecvOutputReady(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Head(chan[r]).kind = "OUTPUT_READY"
    /\ LET m == Head(chan[r]) IN HandleOutputIn(Received(rec, m.out), m)
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, pump, closed, dead, submitted, gone, abortSent, closedStreams>>

\* Dispatcher.expire: the compute deadline of a pending RPC passed; what its
\* reply rank announced is dropped, and its forward is cancelled on the
\* workers (what they answer later is an orphan, dropped on arrival).
ExpireRpc(k) ==
    /\ Pending(k)
    /\ rpcs' = [rpcs EXCEPT ![k] = "timeout"]
    /\ rec' = [i \in Ids |-> IF i \in Announced(k) THEN Drop(rec[i])
                             ELSE IF i \in ChunkIds(k) THEN DropKnown(rec[i]) ELSE rec[i]]
    /\ abortSent' = abortSent \cup {k}
    /\ UNCHANGED <<pump, closed, dead, submitted, answers, perr, gone, closedStreams>>

PumpExpireRpc(k) ==
    /\ EngineAborts /\ pump = "RUNNING"
    /\ ExpireRpc(k)
    /\ UNCHANGED <<worker, channel>>

\* A record whose deadline can pass: the output deadline is armed at
\* COMPUTE_DONE (ABANDON changes nothing in DROPPING and RELEASING); a record
\* that an early OUTPUT_READY created has the deadline Dispatcher._early_deadline
\* armed at its arrival, no earlier than the compute deadline of every call
\* pending then, so its call has ended.
Expirable(i) ==
    \/ rec[i].st \in {"COMPUTE_DONE", "READY", "FAILED", "DROPPING", "RELEASING"}
    \/ rec[i].st \in RequestAwaitingComputeDone /\ ~Pending(RpcOf(i))

\* OutputRegistry.expire: the deadlines of the records S passed.  Each is
\* abandoned (its output deadline), or, still waiting for its COMPUTE_DONE,
\* force-released (its tombstone swallows a COMPUTE_DONE still to come) and
\* counted as orphaned.
ExpireOutputs(S) ==
    /\ \A i \in S : Expirable(i)
    /\ rec' = [i \in Ids |-> IF i \in S THEN Expire1(rec[i]) ELSE rec[i]]
    /\ UNCHANGED <<pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

PumpExpireOutput(i) ==
    /\ EngineAborts /\ pump = "RUNNING"
    /\ ExpireOutputs({i})
    /\ UNCHANGED <<worker, channel>>

\* Dispatcher.forget: the broadcast of pending call k failed part-way; what
\* its reply rank announced is dropped.  (The model's broadcast is atomic, so
\* no step of Next does this; trace validation holds recorded forgets to it.)
Forget(k) ==
    /\ Pending(k)
    /\ rpcs' = [rpcs EXCEPT ![k] = "unsent"]
    /\ rec' = [i \in Ids |-> IF i \in Announced(k) THEN Drop(rec[i])
                             ELSE IF i \in ChunkIds(k) THEN DropKnown(rec[i]) ELSE rec[i]]
    /\ UNCHANGED <<pump, closed, dead, submitted, answers, perr, gone, abortSent, closedStreams>>

-----------------------------------------------------------------------------
(* Engine actions: omni_async.executor.api.DiffusionExecutor.  Each is   *)
(* the engine's choice (its guard) and the executor's step (the registry  *)
(* or dispatcher call it makes, an operator of its own that trace         *)
(* validation holds recorded calls to).                                   *)

\* Dispatcher.submit of execute call k.
Submit(k) ==
    /\ rpcs[k] = "idle"
    /\ submitted' = k
    /\ rpcs' = [rpcs EXCEPT ![k] = "pending"]
    /\ UNCHANGED <<pump, closed, dead, answers, rec, perr, gone, abortSent, closedStreams>>

\* (the model's engine submits the calls in order; a consumer submits nothing
\* once it went away)
EngineSubmitRpc ==
    /\ ~closed /\ ~dead /\ pump = "RUNNING" /\ \A r \in Ranks : alive[r]
    /\ submitted < NumRpcs
    /\ Consumer[submitted + 1] \notin gone
    /\ Submit(submitted + 1)
    /\ UNCHANGED <<worker, channel>>

\* The engine cancels the Future of an execute call before it resolves: the
\* dispatcher keeps waiting for the answers, then drops what the call
\* announced (Dispatcher._complete: the claim of the cancelled Future fails).
CancelRpc(k) ==
    /\ rpcs[k] = "pending"
    /\ rpcs' = [rpcs EXCEPT ![k] = "cancelling"]
    /\ UNCHANGED <<pump, closed, dead, submitted, answers, rec, perr, gone, abortSent, closedStreams>>

EngineCancelRpc(k) ==
    /\ EngineAborts
    /\ CancelRpc(k)
    /\ UNCHANGED <<worker, channel>>

\* Dispatcher.cancel: the engine aborts call k in flight (cancel_requests of
\* all its requests): the call is marked and a cancel goes to every rank's
\* control channel.  The call still ends by its ranks' answers.
AbortRpc(k) ==
    /\ Pending(k) /\ k \notin abortSent
    /\ abortSent' = abortSent \cup {k}
    /\ UNCHANGED <<pump, closed, dead, submitted, rpcs, answers, rec, perr, gone, closedStreams>>

EngineAbortRpc(k) ==
    /\ CancelsForward
    /\ AbortRpc(k)
    /\ UNCHANGED <<worker, channel>>

\* Dispatcher.close_stream: the engine closes the stream of call k (it stops
\* reading: RequestStream.close, a closed generate_stream): every chunk it
\* learned of and did not take is dropped, and later ones are dropped on
\* arrival.  The call goes on.
CloseStream(k) ==
    /\ closedStreams' = closedStreams \cup {k}
    /\ rec' = [i \in Ids |-> IF i \in ChunkIds(k) THEN DropKnown(rec[i]) ELSE rec[i]]
    /\ UNCHANGED <<pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent>>

EngineCloseStream(k) ==
    /\ EngineAborts /\ ~closed /\ Chunks[k] # <<>> /\ rpcs[k] # "idle" /\ k \notin closedStreams
    /\ CloseStream(k)
    /\ UNCHANGED <<worker, channel>>

\* The consumer c goes away without aborting (F11): Dispatcher.release_consumer
\* (disp) fails its pending calls ("consumer gone"; what they announce later
\* is an orphan, dropped on arrival), then OutputRegistry.release_consumer
\* abandons every record it owns: those whose COMPUTE_DONE arrived while
\* their call was pending (a record in another state has no consumer yet, or
\* ABANDON changes nothing there).  F11: the reference kept them cached.
ReleaseConsumer(c, disp) ==
    /\ gone' = gone \cup {c}
    /\ rpcs' = IF disp THEN [k \in RpcIds |-> IF Pending(k) /\ Consumer[k] = c THEN "gone" ELSE rpcs[k]]
               ELSE rpcs
    /\ rec' = [i \in Ids |->
                 LET mine == Consumer[RpcOf(i)] = c
                     y == IF mine /\ rec[i].st \in {"COMPUTE_DONE", "PACKING", "READY", "FAILED"}
                          THEN Abandon(FailWaiter(rec[i])) ELSE rec[i]
                 IN [y EXCEPT !.eng = IF @ = "known" /\ mine THEN "done" ELSE @]]
    /\ UNCHANGED <<pump, closed, dead, submitted, answers, perr, abortSent, closedStreams>>

EngineReleaseConsumer ==
    /\ EngineAborts /\ ~closed
    /\ \E c \in Consumers \ gone : ReleaseConsumer(c, TRUE)
    /\ UNCHANGED <<worker, channel>>

\* OutputRegistry.wait: a live record that is still wanted gets a waiter.
Wanted(i) == rec[i].st \notin {"NONE", "DROPPING", "DROPPING_EARLY", "RELEASING", "RELEASING_EARLY"}
RegistryWait(i) ==
    /\ ~closed /\ Wanted(i) /\ rec[i].waiter = "none"
    /\ rec' = [rec EXCEPT ![i] = AfterChange([@ EXCEPT !.waiter = "waiting", !.eng = "waiting"])]
    /\ UNCHANGED <<pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

\* wait_output_ready for an id the engine learned: one that is gone or
\* unwanted fails at once.
EngineWaitOutput(i) ==
    /\ ~closed /\ rec[i].eng = "known"
    /\ \/ RegistryWait(i)
       \/ /\ ~Wanted(i)
          /\ rec' = [rec EXCEPT ![i] = [@ EXCEPT !.eng = "done", !.nres = @ + 1]]
          /\ UNCHANGED <<pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>
    /\ UNCHANGED <<worker, channel>>

\* The engine cancels its Future; the registry hears of it in the done-callback.
CancelWait(i) ==
    /\ rec[i].waiter = "waiting"
    /\ rec' = [rec EXCEPT ![i].waiter = "cancelled", ![i].eng = "done", ![i].nres = @ + 1, ![i].gaveUp = TRUE]
    /\ UNCHANGED <<pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

EngineCancelWait(i) ==
    /\ EngineAborts
    /\ CancelWait(i)
    /\ UNCHANGED <<worker, channel>>

\* The done-callback of a cancelled Future: OutputRegistry.cancel.
RegistryCancelWaiter(i) ==
    /\ rec[i].waiter = "cancelled"
    /\ rec' = [rec EXCEPT ![i] = Abandon([@ EXCEPT !.waiter = "none"])]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

\* OutputRegistry.drop (drop_output, abort), valid in every state (F10).
DropOutput(i) ==
    /\ rec' = [rec EXCEPT ![i] = [Drop(@) EXCEPT !.eng = "done", !.dropped = TRUE]]
    /\ UNCHANGED <<pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

EngineDropOutput(i) ==
    /\ EngineAborts /\ ~closed /\ rec[i].eng \in {"known", "waiting"}
    /\ DropOutput(i)
    /\ UNCHANGED <<worker, channel>>

\* The consumer is done with a delivered output and gives its segment back.
EngineReleaseOutput(i) ==
    /\ rec[i].eng = "holding"
    /\ rec' = [rec EXCEPT ![i] = [(IF @.seg = "consumer" THEN ReleaseSeg(@) ELSE @) EXCEPT !.eng = "done"]]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

\* fail_all's parts: every pending call fails, every record is force-released
\* (the engine hears of each), close stops the pump.
FailRpcs == [k \in RpcIds |-> IF Pending(k) THEN "shutdown" ELSE rpcs[k]]
FailRec(x) == [ForceRelease(x) EXCEPT !.eng = IF @ = "known" THEN "done" ELSE @]
StopPump == IF LifecycleCan(pump, "DRAIN") THEN LifecycleNext(LifecycleNext(pump, "DRAIN"), "STOPPED") ELSE pump

\* Dispatcher.fail_all (disp) or OutputRegistry.fail_all alone: nothing more
\* will arrive; with close the registry also refuses new work (F16).
FailAll(close, disp) ==
    /\ closed' = (closed \/ close)
    /\ pump' = IF close THEN StopPump ELSE pump
    /\ rpcs' = IF disp THEN FailRpcs ELSE rpcs
    /\ rec' = [i \in Ids |-> FailRec(rec[i])]
    /\ UNCHANGED <<dead, submitted, answers, perr, gone, abortSent, closedStreams>>

\* Shutdown: close the registry (fail every waiter and RPC, release every
\* record), stop the workers; the pool's close unlinks every segment still out
\* (in a packer, shipped, in an unread message).
CloseAll ==
    /\ closed' = TRUE
    /\ pump' = StopPump
    /\ rpcs' = FailRpcs
    /\ rec' = [i \in Ids |-> LET y == FailRec(rec[i]) IN IF y.seg \in {"leased", "shipped"} THEN ReleaseSeg(y) ELSE y]
    /\ alive' = [r \in Ranks |-> FALSE]
    /\ chan' = [r \in Ranks |-> <<>>]
    /\ recvd' = sent
    /\ packQ' = <<>>
    /\ packing' = NoId
    /\ UNCHANGED eof

EngineShutdown ==
    /\ EngineAborts /\ ~closed
    /\ CloseAll
    /\ UNCHANGED <<mainPc, mainRpc, failedRanks, ws, crashes, sent, dead, submitted, answers, perr, gone, abortSent, closedStreams>>

\* The monitor sees a dead worker (MultiprocDiffusionExecutor._on_worker_death):
\* SegmentPool.reclaim_owner(pid) frees the segment the dead packer had leased
\* and not handed off, then ResultPump.fail_all(..., close=True) fails every
\* waiter and call and closes the registry.  The pump keeps reading: what the
\* dead worker (or a live one) sent is released on arrival; the other workers
\* live on.  A segment the dead packer had shipped is spared: its message may
\* still be in the pipe (PumpReachEof takes the rest; ReclaimShipped frees
\* them here).  Without the close, a message read after fail_all makes a
\* record for nobody (DeathKeepsOpen).
MonitorDetectDeath ==
    /\ ~dead /\ ~closed /\ \E r \in Ranks : ~alive[r]
    /\ dead' = TRUE
    /\ closed' = TRUE
    /\ rpcs' = FailRpcs
    /\ LET own(i) == ~alive[ReplyRank] /\ packing = i /\ rec[i].seg = "leased"
       IN /\ rec' = [i \in Ids |-> FailRec(IF own(i) THEN ReleaseSeg(rec[i]) ELSE rec[i])]
          /\ packing' = IF packing # NoId /\ own(packing) THEN NoId ELSE packing
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, ws, packQ, crashes, channel, pump, submitted, answers,
                   perr, gone, abortSent, closedStreams>>

\* The pump reads a dead rank's pipe to its end (PipeChannel's on_sender_gone:
\* every message the rank wrote was handled, its leases marked received) and
\* the monitor has handled the death: whichever comes second
\* (MultiprocDiffusionExecutor._reclaim_shipped) frees what the rank shipped
\* and no message carried, SegmentPool.reclaim_shipped(pid): the packer was
\* killed between the hand-off and the send (ReclaimSparesShipped: without
\* it, the long soak's lease left out until shutdown).
PumpReachEof(r) ==
    /\ pump = "RUNNING" /\ dead /\ ~alive[r] /\ chan[r] = <<>> /\ r \notin eof
    /\ eof' = eof \cup {r}
    /\ IF r = ReplyRank
       THEN /\ rec' = [i \in Ids |-> IF rec[i].seg = "shipped" THEN ReleaseSeg(rec[i]) ELSE rec[i]]
            /\ packing' = NoId
       ELSE UNCHANGED <<rec, packing>>
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, ws, packQ, crashes, chan, sent, recvd,
                   pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

-----------------------------------------------------------------------------
PumpRecv(r) == PumpRecvComputeDone(r) \/ PumpRecvRpcResult(r) \/ PumpRecvOutputReady(r) \/ PumpRecvChunk(r)

Next ==
    \/ EngineSubmitRpc
    \/ EngineShutdown
    \/ MonitorDetectDeath
    \/ PackerPackOutput
    \/ PackerHandOff
    \/ PackerSendOutputReady
    \/ PackerSendOutputFailed
    \/ PackerCancelOutput
    \/ \E r \in Ranks :
          \/ WorkerMainForward(r)
          \/ WorkerMainEmitChunk(r)
          \/ WorkerMainSendComputeDone(r)
          \/ WorkerMainComputeDoneFails(r)
          \/ WorkerMainSendRpcResult(r)
          \/ WorkerCrash(r)
          \/ PumpRecv(r)
          \/ PumpReachEof(r)
    \/ EngineReleaseConsumer
    \/ \E k \in RpcIds : PumpExpireRpc(k) \/ EngineCancelRpc(k) \/ EngineAbortRpc(k) \/ EngineCloseStream(k)
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
          \/ WorkerMainEmitChunk(r)
          \/ WorkerMainSendComputeDone(r)
          \/ WorkerMainSendRpcResult(r)
          \/ PumpRecv(r)
          \/ PumpReachEof(r)
    \/ PackerPackOutput
    \/ PackerHandOff
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

\* A leased (or shipped) segment always has an owner: the packer, an unread
\* OUTPUT_READY, or a registry record; one the consumer holds was delivered to it.
NoSegmentLeak ==
    \A i \in Ids :
        /\ rec[i].seg \in {"leased", "shipped"} =>
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

\* The registry has seen the COMPUTE_DONE that named i (a record past it, or
\* a tombstone that no longer expects it).
CdSeen(i) ==
    \/ rec[i].st \notin {"NONE"} \cup RequestAwaitingComputeDone
    \/ "fin" \in rec[i].late /\ "cd" \notin rec[i].late

\* An execute call resolves as success only on its reply rank's COMPUTE_DONE
\* (every id it produces registered): never on a CHUNK (ChunkResolvesCall).
ResolvedOnComputeDone == \A k \in RpcIds : rpcs[k] = "ok" => \A i \in Range(Batch[k]) : CdSeen(i)

\* The engine learns of a stream's chunks in order (one FIFO per rank; the
\* worker emits them in order): never of one before an earlier one.
ChunksInOrder ==
    \A k \in RpcIds : \A n \in DOMAIN Chunks[k] : \A m \in 1..(n - 1) :
        rec[Chunks[k][n]].eng # "none" => rec[Chunks[k][m]].eng # "none" \/ rec[Chunks[k][m]].dropped

\* An RPC with a failed rank never resolves as success (F12).
RpcFailureNeverSuccess == \A k \in RpcIds : rpcs[k] = "ok" => failedRanks[k] = {}

\* A COMPUTE_DONE naming i (or the failure that replaces it) is still to come.
\* For a chunk: its CHUNK is still to come.
CdToCome(i) ==
    LET k == RpcOf(i) IN
    IF IsChunk(i)
    THEN \/ \E m \in MsgsOf(ReplyRank) : m.kind = "CHUNK" /\ m.id = i
         \/ alive[ReplyRank] /\ ws[i] = "QUEUED"
    ELSE \/ \E m \in MsgsOf(ReplyRank) : i \in m.ids
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
\* RPC, no claim by the engine, no dead worker whose pipe the running pump has
\* not read to its end (after the monitor saw the death: PumpReachEof).
Idle ==
    /\ \A r \in Ranks : chan[r] = <<>>
    /\ \A r \in Ranks : alive[r] => mainPc[r] = "idle" /\ mainRpc[r] = submitted
    /\ alive[ReplyRank] => packQ = <<>> /\ packing = NoId
    /\ \A k \in RpcIds : ~Pending(k)
    /\ \A i \in Ids : rec[i].eng \in {"none", "done"} /\ rec[i].waiter = "none"
    /\ \A r \in Ranks : ~alive[r] => r \in eof \/ pump # "RUNNING"

\* The registry and the segment pool are empty whenever nothing is in flight:
\* also after a worker's death, before the engine shuts down
\* (ReclaimSparesShipped).
QuiescentClean ==
    Idle => \A i \in Ids : rec[i].st = "NONE" /\ rec[i].seg \in {"none", "released"}

\* Something excuses a failure of i, for good: a rank's forward or answer
\* failed, its packing failed, a worker crashed, the engine cancelled the call
\* or dropped the output, the call timed out, the consumer went away, shutdown.
ExcusedOtherwise(i) ==
    LET k == RpcOf(i) IN
    \/ failedRanks[k] # {} \/ rpcs[k] \in {"cancelling", "cancelled", "timeout"} \/ k \in abortSent
    \/ ws[i] = "FAILED" \/ rec[i].dropped \/ crashes > 0 \/ closed \/ Consumer[RpcOf(i)] \in gone
    \/ IsChunk(i) /\ k \in closedStreams

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
\* And the tombstones of a closed registry: the pump has stopped, nothing
\* reads them again.
View == <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams,
          [i \in Ids |-> LET x == IF ExcusedOtherwise(i) THEN [rec[i] EXCEPT !.gaveUp = FALSE] ELSE rec[i]
                         IN IF closed THEN [x EXCEPT !.late = {}] ELSE x]>>

-----------------------------------------------------------------------------
(* Properties (FairSpec). *)

\* Nothing of i is left anywhere: the worker is done with it (or dead), no
\* message names it, the registry has no record, the engine holds nothing.
Settled(i) ==
    /\ rpcs[RpcOf(i)] # "idle" /\ ~Pending(RpcOf(i))
    /\ ws[i] \in RequestTerminal \cup {"READY", "FAILED"} \/ ~alive[ReplyRank]
    /\ packing # i /\ ~CdToCome(i)
    /\ ~\E r \in Ranks : \E m \in MsgsOf(r) : m.id = i
    /\ rec[i].st = "NONE" /\ rec[i].eng \in {"none", "done"} /\ rec[i].seg \notin {"leased", "shipped"}

\* Every submitted request reaches a terminal state and leaves nothing behind,
\* also when a worker crashes.
RequestsTerminate == \A k \in RpcIds : rpcs[k] # "idle" ~> \A i \in BatchIds[k] \cup ChunkIds(k) : Settled(i)

\* Every waiter is eventually resolved.
WaitersResolve == \A i \in Ids : rec[i].waiter = "waiting" ~> rec[i].waiter # "waiting"

\* Every RPC is eventually resolved.
RpcsResolve == \A k \in RpcIds : Pending(k) ~> ~Pending(k)

=============================================================================
