-------------------------- MODULE MCAsyncOutputBugs --------------------------
(***************************************************************************)
(* The buggy variants of AsyncOutput: each failure mode of the reference   *)
(* implementation (DESIGN.md, F1-F16) and each bug that TLC or the soak    *)
(* found is one operator of AsyncOutput written the way the code did it    *)
(* before the fix.  The main spec has no switch: a cfg in buggy/ swaps the *)
(* operator in with TLC's definition override, e.g.                        *)
(*     CONSTANTS Abandon <- F9_Abandon                                     *)
(* so every action that uses it uses the buggy one, and TLC must reject    *)
(* the model with the invariant or property tla/README.md names.  A        *)
(* buggy operator never calls the one it replaces (the override would make *)
(* it call itself): it repeats the correct part.                           *)
(***************************************************************************)
EXTENDS MCAsyncOutput

-----------------------------------------------------------------------------
(* Registry operators. *)

\* F9: _abandon only forgot the waiter, so an output that arrived later was
\* cached for nobody.  (Abandon <- F9_Abandon)
F9_Abandon(x) ==
    IF x.st \notin RequestHolding THEN x
    ELSE AfterChange(Discard(RFire(x, "ABANDON")))

\* F10: drop removed the waiter but kept the cached output.  (Drop <- F10_Drop)
F10_Drop(x) ==
    IF x.st = "NONE" THEN x
    ELSE LET y == [FailWaiter(x) EXCEPT !.dropped = TRUE] IN
         IF y.st \in RequestHolding THEN y
         ELSE AfterChange(Discard(RFire(y, "DROP")))

\* F16: fail_all failed the waiters but kept the cached outputs.
\* (ForceRelease <- F16_ForceRelease)
F16_ForceRelease(x) == IF x.st = "NONE" THEN x ELSE FailWaiter(x)

-----------------------------------------------------------------------------
(* The channel. *)

\* F7: two threads wrote a single-writer queue; both took the same tail slot
\* and the later store overwrote the other thread's message.  (Send <- F7_Send)
F7_Send(r, m) ==
    /\ sent' = [sent EXCEPT ![r] = @ + 1]
    /\ UNCHANGED eof
    /\ \/ chan' = [chan EXCEPT ![r] = Append(@, m)]
       \/ /\ chan[r] # <<>>
          /\ chan[r][Len(chan[r])].w # m.w
          /\ chan' = [chan EXCEPT ![r] = Append(SubSeq(@, 1, Len(@) - 1), m)]

-----------------------------------------------------------------------------
(* Worker actions. *)

\* SendFailKeepsShipped (defect 3): the failure that replaces a COMPUTE_DONE
\* whose put raised names nothing (the reference's WorkerLoop._send fallback),
\* so an output the packer ships is held for nobody.
\* (WorkerMainComputeDoneFails <- SendFailKeepsShipped_WorkerMainComputeDoneFails)
SendFailKeepsShipped_WorkerMainComputeDoneFails(r) ==
    /\ SendFails /\ alive[r] /\ r = ReplyRank /\ mainPc[r] = "sendOk"
    /\ Batch[mainRpc[r]] # <<>> /\ Unemitted(mainRpc[r]) = {}
    /\ failedRanks' = [failedRanks EXCEPT ![mainRpc[r]] = @ \cup {r}]
    /\ Send(r, [kind |-> "RPC_RESULT", rpc |-> mainRpc[r], id |-> NoId, ok |-> FALSE,
                out |-> NoId, w |-> "main", ids |-> {}])
    /\ mainPc' = [mainPc EXCEPT ![r] = "idle"]
    /\ UNCHANGED <<alive, mainRpc, ws, packQ, packing, crashes, recvd, executor>>

\* PackerCancelsUndropped (defect 7): the guard of the packer's cancellation
\* (F15) is gone: it cancels an output that nobody dropped.
\* (PackerCancelOutput <- PackerCancelsUndropped_PackerCancelOutput)
PackerCancelsUndropped_PackerCancelOutput ==
    /\ alive[ReplyRank] /\ packing = <<>> /\ packQ # <<>>
    /\ LET i == Head(packQ) IN
       /\ ws' = [ws EXCEPT ![i] = RequestNext(RequestNext(@, "DROP"), "OUTPUT_FAILED")]
       /\ Send(ReplyRank, [kind |-> "OUTPUT_READY", rpc |-> 0, id |-> i, ok |-> FALSE,
                           out |-> NoId, w |-> "packer", ids |-> {}])
       /\ packQ' = Tail(packQ)
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packing, crashes, recvd, executor>>

-----------------------------------------------------------------------------
(* Pump actions: the dispatcher. *)

\* F12: the reference resolved the call on the reply rank's answer, before
\* the other ranks had answered.  (Complete <- F12_Complete)
F12_Complete(k, ansk, r) == r = ReplyRank

\* CancelKeepsOutputs: when the engine cancelled the call's Future, the claim
\* fails and nothing else happens: what the call announced stays.
\* (DropsAnnounced <- CancelKeepsOutputs_DropsAnnounced)
CancelKeepsOutputs_DropsAnnounced(fail, cancelled, aborted) == fail \/ aborted

\* AbortKeepsFinished (issue 9): an aborted call whose forward finished anyway
\* fails with RequestAborted (Dispatcher._complete_aborted without its
\* _drop_all), but what it announced is not dropped.
\* (DropsAnnounced <- AbortKeepsFinished_DropsAnnounced)
AbortKeepsFinished_DropsAnnounced(fail, cancelled, aborted) == fail \/ cancelled

\* ChunkOrphanKept: a chunk of a call that is no longer pending is registered
\* and kept instead of dropped on arrival.
\* (ChunkArrives <- ChunkOrphanKept_ChunkArrives)
ChunkOrphanKept_ChunkArrives(r, k, i) ==
    LET x == OnComputeDone(rec[i]) IN
    IF ~CdAccepted(rec[i]) THEN x
    ELSE IF ChunkWanted(r, k) THEN [x EXCEPT !.eng = "known"]
    ELSE IF ~Pending(k) THEN x
    ELSE [Drop(x) EXCEPT !.eng = "done"]

\* ChunkResolvesCall: the dispatcher takes the reply rank's chunk, when the
\* engine wants it, for that rank's answer.
\* (HandleChunk <- ChunkResolvesCall_HandleChunk)
ChunkResolvesCall_HandleChunk(r, m) ==
    LET k == m.rpc
        i == m.id
        x == OnComputeDone(rec[i])
    IN IF k = NoCall
       THEN /\ perr' = TRUE
            /\ rec' = [rec EXCEPT ![i] = IF CdAccepted(rec[i]) THEN [Drop(x) EXCEPT !.ghost = TRUE] ELSE x]
            /\ UNCHANGED <<rpcs, answers>>
       ELSE /\ perr' = (perr \/ CdRefused(rec[i]) \/ (Pending(k) /\ r # ReplyRank))
            /\ IF ChunkWanted(r, k) /\ answers[k][r] = "none"
               THEN Answer(k, r, "ok", [rec EXCEPT ![i] = ChunkArrives(r, k, i)])
               ELSE rec' = [rec EXCEPT ![i] = ChunkArrives(r, k, i)] /\ UNCHANGED <<rpcs, answers>>

\* F6: the reference split a batch output by a map registered at COMPUTE_DONE;
\* an output that arrived first found no map and was thrown away (its segment
\* with nobody to release it).  (PumpRecvOutputReady <- F6_PumpRecvOutputReady)
F6_PumpRecvOutputReady(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Head(chan[r]).kind = "OUTPUT_READY"
    /\ LET m == Head(chan[r])
           got == Received(rec, m.out)
       IN IF got[m.id].st = "NONE"
          THEN rec' = got /\ UNCHANGED <<perr, rpcs, answers>>
          ELSE HandleOutputIn(got, m)
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, pump, closed, dead, submitted, gone, abortSent, closedStreams>>

\* F3: a waiter cancelled between "is it done?" and "set result" raised inside
\* the pump and killed it (lifecycle CRASH); nothing fails the other waiters.
\* (PumpRecvOutputReady <- F3_PumpRecvOutputReady)
F3_PumpRecvOutputReady(r) ==
    /\ pump = "RUNNING" /\ chan[r] # <<>> /\ Head(chan[r]).kind = "OUTPUT_READY"
    /\ LET m == Head(chan[r])
           got == Received(rec, m.out)
           x == got[m.id]
       IN IF ~OutRefused(x, m.ok) /\ ClaimFails(Arrive(x, m.ok, m.out))
          THEN /\ pump' = LifecycleNext(pump, "CRASH")
               /\ rec' = [got EXCEPT ![m.id] = Arrive(x, m.ok, m.out)]
               /\ UNCHANGED <<perr, rpcs, answers>>
          ELSE HandleOutputIn(got, m) /\ UNCHANGED pump
    /\ Recv(r)
    /\ UNCHANGED <<worker, sent, closed, dead, submitted, gone, abortSent, closedStreams>>

-----------------------------------------------------------------------------
(* Engine actions. *)

\* F11: when the consumer went away, the reference failed its calls but kept
\* the outputs it owned cached.  (ReleaseConsumer <- F11_ReleaseConsumer)
F11_ReleaseConsumer(c, disp) ==
    /\ gone' = gone \cup {c}
    /\ rpcs' = IF disp THEN [k \in RpcIds |-> IF Pending(k) /\ Consumer[k] = c THEN "gone" ELSE rpcs[k]]
               ELSE rpcs
    /\ rec' = [i \in Ids |-> [rec[i] EXCEPT !.eng = IF @ = "known" /\ Consumer[RpcOf(i)] = c THEN "done" ELSE @]]
    /\ UNCHANGED <<pump, closed, dead, submitted, answers, perr, abortSent, closedStreams>>

-----------------------------------------------------------------------------
(* A worker's death. *)

\* DeathKeepsOpen (found by TLC): MultiprocDiffusionExecutor._on_worker_death
\* called fail_all without closing the registry: every record is
\* force-released (leaving a tombstone that swallows its late messages, as
\* OutputRegistry._finished does), and the registry stays open.
\* (MonitorDetectDeath <- DeathKeepsOpen_MonitorDetectDeath)
DeathKeepsOpen_MonitorDetectDeath ==
    /\ ~dead /\ ~closed /\ \E r \in Ranks : ~alive[r]
    /\ dead' = TRUE
    /\ closed' = FALSE
    /\ rpcs' = FailRpcs
    /\ LET own(i) == ~alive[ReplyRank] /\ InPacking(i) /\ rec[i].seg = "leased"
       IN /\ rec' = [i \in Ids |-> FailRec(IF own(i) THEN ReleaseSeg(rec[i]) ELSE rec[i])]
          /\ packing' = SelectSeq(packing, LAMBDA i : ~own(i))
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, ws, packQ, crashes, channel, pump, submitted, answers,
                   perr, gone, abortSent, closedStreams>>

\* ReclaimShipped: a reclaim_owner(pid) that also frees the leases the dead
\* reply rank had shipped (as if hand_off did not exist), before fail_all
\* discards what the registry holds.
\* (MonitorDetectDeath <- ReclaimShipped_MonitorDetectDeath)
ReclaimShipped_MonitorDetectDeath ==
    /\ ~dead /\ ~closed /\ \E r \in Ranks : ~alive[r]
    /\ dead' = TRUE
    /\ closed' = TRUE
    /\ rpcs' = FailRpcs
    /\ LET own(i) == ~alive[ReplyRank] /\ InPacking(i) /\ rec[i].seg = "leased"
           stolen(i) == ~alive[ReplyRank] /\ rec[i].seg \in {"leased", "shipped", "consumer"}
       IN /\ rec' = [i \in Ids |-> FailRec(IF own(i) \/ stolen(i) THEN ReleaseSeg(rec[i]) ELSE rec[i])]
          /\ packing' = SelectSeq(packing, LAMBDA i : ~(own(i) \/ stolen(i)))
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, ws, packQ, crashes, channel, pump, submitted, answers,
                   perr, gone, abortSent, closedStreams>>

\* ReclaimHeadOnly (two copies in flight): reclaim_owner(pid) freeing only the
\* oldest lease of the dead packer, as if it held one at a time: with
\* PackDepth = 2 the second copy's segment is leased by nobody alive.
\* tests/transport/test_shm.py::test_sigkilled_child_cleanup holds the code to
\* freeing every lease the dead process took and did not hand off.
\* (MonitorDetectDeath <- ReclaimHeadOnly_MonitorDetectDeath)
ReclaimHeadOnly_MonitorDetectDeath ==
    /\ ~dead /\ ~closed /\ \E r \in Ranks : ~alive[r]
    /\ dead' = TRUE
    /\ closed' = TRUE
    /\ rpcs' = FailRpcs
    /\ LET own(i) == ~alive[ReplyRank] /\ packing # <<>> /\ i = Head(packing) /\ rec[i].seg = "leased"
       IN /\ rec' = [i \in Ids |-> FailRec(IF own(i) THEN ReleaseSeg(rec[i]) ELSE rec[i])]
          /\ packing' = SelectSeq(packing, LAMBDA i : ~own(i))
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, ws, packQ, crashes, channel, pump, submitted, answers,
                   perr, gone, abortSent, closedStreams>>

\* ReclaimSparesShipped (the long soak, issue 8): once the dead worker's pipe
\* is read to its end, nothing frees what it shipped and no message carried
\* (reclaim_owner rightly spared it): the lease is out until shutdown.
\* (PumpReachEof <- ReclaimSparesShipped_PumpReachEof)
ReclaimSparesShipped_PumpReachEof(r) ==
    /\ pump = "RUNNING" /\ dead /\ ~alive[r] /\ chan[r] = <<>> /\ r \notin eof
    /\ eof' = eof \cup {r}
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, ws, packQ, packing, crashes, chan, sent, recvd,
                   rec, pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>
=============================================================================
