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
(* The spec is split by concern, each module extending the one before:     *)
(*   AsyncOutputState: constants, variables, TypeOK, Init, the channel;    *)
(*   AsyncOutputRegistry: the registry's operators on one record, one per  *)
(*     method of omni_async.core.registry.OutputRegistry;                  *)
(*   AsyncOutputWorker: the workers' actions;                              *)
(*   AsyncOutputExecutor: the pump's, the engine's and the monitor's;      *)
(*   AsyncOutput (this module): Next, Spec, fairness, the invariants and   *)
(*     properties.  spec/PROTOCOL.md names the code of each action.        *)
(* It is the correct protocol only: the failure modes of the reference     *)
(* implementation (DESIGN.md, F1-F16) and the bugs TLC found are in        *)
(* MCAsyncOutputBugs.tla, each one operator of the spec replaced in its    *)
(* cfg (buggy/*.cfg), so that TLC can show what each one breaks.           *)
(***************************************************************************)
EXTENDS AsyncOutputWorker, AsyncOutputExecutor

-----------------------------------------------------------------------------
(* The spec. *)

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
              \/ InPacking(i)
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
    /\ alive[ReplyRank] => packQ = <<>> /\ packing = <<>>
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
    /\ ~InPacking(i) /\ ~CdToCome(i)
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
