------------------------- MODULE AsyncOutputWorker --------------------------
(***************************************************************************)
(* The worker side of AsyncOutput: each rank's main thread                 *)
(* (omni_async.worker.loop.WorkerLoop.handle_rpc), the reply rank's packer *)
(* (omni_async.worker.packer.Packer._launch, ._finish), a worker's crash.  *)
(***************************************************************************)
EXTENDS AsyncOutputRegistry

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
\* Up to PackDepth outputs are in flight (WorkerOptions.copies_in_flight): the
\* packer thread leases and queues the next copy (Packer._launch) while the
\* finisher thread still waits for the one before it; the finisher ends them
\* oldest first (PackInFlight.finish: the hand-off, then the send), so the steps
\* below act on Head(packing).  A cancel waits until nothing is in flight.
\* (A device stage may have run on the output while it was queued, on the stager's
\* stream: that sends nothing and leases nothing, so it is no step of this spec; the
\* output is still in packQ, and PackerCancelOutput may still cancel it.)
PackerPackOutput ==
    /\ alive[ReplyRank] /\ Len(packing) < PackDepth /\ packQ # <<>>
    /\ LET i == Head(packQ) IN
       /\ RequestCan(ws[i], "PACK")
       /\ ws' = [ws EXCEPT ![i] = RequestNext(@, "PACK")]
       /\ rec' = [rec EXCEPT ![i].seg = "leased"]
       /\ packing' = Append(packing, i)
       /\ packQ' = Tail(packQ)
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, crashes, channel, pump, closed, dead,
                   submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

\* The copy is done: the lease is handed off (SegmentPool.hand_off, at the end
\* of pack_diffusion_output_shm), right before the message is put.  From here
\* the dead worker's reclaim_owner spares it (its message may be in the pipe,
\* ReclaimShipped); a crash between this step and the send leaves it shipped
\* with no message: PumpReachEof reclaims it.
PackerHandOff ==
    /\ alive[ReplyRank] /\ packing # <<>> /\ rec[Head(packing)].seg = "leased"
    /\ rec' = [rec EXCEPT ![Head(packing)].seg = "shipped"]
    /\ UNCHANGED <<worker, channel, pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

PackerSendOutputReady ==
    /\ alive[ReplyRank] /\ packing # <<>> /\ rec[Head(packing)].seg = "shipped"
    /\ LET i == Head(packing) IN
       /\ ws' = [ws EXCEPT ![i] = RequestNext(@, "OUTPUT_READY")]
       /\ Send(ReplyRank, [kind |-> "OUTPUT_READY", rpc |-> 0, id |-> i, ok |-> TRUE,
                           out |-> i, w |-> "packer", ids |-> {}])
    /\ packing' = Tail(packing)
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packQ, crashes, recvd, executor>>

\* Packing failed (or, after the hand-off, the put of OUTPUT_READY raised): the
\* segment goes back, the failure travels typed (F2).
PackerSendOutputFailed ==
    /\ PackFails
    /\ alive[ReplyRank] /\ packing # <<>>
    /\ LET i == Head(packing) IN
       /\ ws' = [ws EXCEPT ![i] = RequestNext(@, "OUTPUT_FAILED")]
       /\ rec' = [rec EXCEPT ![i] = ReleaseSeg(@)]
       /\ Send(ReplyRank, [kind |-> "OUTPUT_READY", rpc |-> 0, id |-> i, ok |-> FALSE,
                           out |-> NoId, w |-> "packer", ids |-> {}])
    /\ packing' = Tail(packing)
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, packQ, crashes, recvd,
                   pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

\* F15: the engine dropped the output before packing started; the drop reached
\* the packer (Packer.drop), which sends a "Cancelled" failure instead.  Only
\* for an output the engine dropped (PackerCancelsUndropped: NoSpuriousFailure).
PackerCancelOutput ==
    /\ alive[ReplyRank] /\ packing = <<>> /\ packQ # <<>>
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

=============================================================================
