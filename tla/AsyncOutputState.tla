-------------------------- MODULE AsyncOutputState --------------------------
(***************************************************************************)
(* The state of AsyncOutput (the protocol: AsyncOutput.tla): its           *)
(* constants, what they define (the ids of each call, the message and the  *)
(* record types), its variables, TypeOK and Init; and the result channel's *)
(* put and get.  Every other module of the spec extends this one.          *)
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
    MaxQueue,       \* state constraint: messages per rank FIFO
    PackDepth       \* how many outputs the packer may have in flight (copies queued), >= 1

ASSUME ReplyRank \in Ranks
ASSUME PackDepth \in Nat \ {0}

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
    packing,      \* the ids the packer is copying, oldest first (at most PackDepth)
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

\* i is one of the outputs the packer is copying.
InPacking(i) == i \in Range(packing)

-----------------------------------------------------------------------------
TypeOK ==
    /\ alive \in [Ranks -> BOOLEAN]
    /\ mainPc \in [Ranks -> {"idle", "sendOk", "sendFail", "sendAborted"}]
    /\ mainRpc \in [Ranks -> 0..NumRpcs]
    /\ failedRanks \in [RpcIds -> SUBSET Ranks]
    /\ ws \in [Ids -> RequestStates]
    /\ packQ \in Seq(Ids)
    /\ packing \in Seq(Ids) /\ Len(packing) <= PackDepth
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
    /\ packing = <<>>
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

=============================================================================
