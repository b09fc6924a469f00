------------------------ MODULE AsyncOutputExecutor -------------------------
(***************************************************************************)
(* The executor side of AsyncOutput: the pump with the dispatcher and the  *)
(* registry, the engine's actions, shutdown, the monitor.  Each step of    *)
(* the executor (the pump handling a message, a registry or dispatcher     *)
(* call an engine action or a deadline makes) is an operator of its own,   *)
(* which TraceAsyncOutput.tla holds recorded runs to.                      *)
(***************************************************************************)
EXTENDS AsyncOutputRegistry

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
    /\ packing' = <<>>
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
    /\ LET own(i) == ~alive[ReplyRank] /\ InPacking(i) /\ rec[i].seg = "leased"
       IN /\ rec' = [i \in Ids |-> FailRec(IF own(i) THEN ReleaseSeg(rec[i]) ELSE rec[i])]
          /\ packing' = SelectSeq(packing, LAMBDA i : ~own(i))
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
            /\ packing' = <<>>
       ELSE UNCHANGED <<rec, packing>>
    /\ UNCHANGED <<alive, mainPc, mainRpc, failedRanks, ws, packQ, crashes, chan, sent, recvd,
                   pump, closed, dead, submitted, rpcs, answers, perr, gone, abortSent, closedStreams>>

=============================================================================
