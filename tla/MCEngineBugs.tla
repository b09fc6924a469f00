----------------------------- MODULE MCEngineBugs -----------------------------
(***************************************************************************)
(* The buggy variants of EngineLifecycle (issue 17's defects 1-3 and 5):   *)
(* each is EngineLifecycle with one action replaced (NextWith), the way    *)
(* the engine did it before the fix; the main spec has no switch.  A cfg   *)
(* in buggy/ picks one with SPECIFICATION E<n>Spec.                        *)
(***************************************************************************)
EXTENDS EngineLifecycle

\* E1 (defect 1): a failed start marks the engine closed (a bare assignment:
\* the old `_closed = True`) but never sets the event close() waits on, so a
\* later close() sees "closing" and waits for ever.
E1StartFinish ==
    IF startPc = "await" /\ factory = "failed"
    THEN /\ startPc' = "done" /\ eng' = "CLOSING" /\ Silent
         /\ UNCHANGED <<stage, factory, exec, owned, closePc, closedEvt, callPc, net, wk, cancelSent,
                        dataQ, ctrlQ, ioBusy>>
    ELSE StartFinish
E1Spec == Init /\ [][NextWith(E1StartFinish, StartCancelled, DriverCancel)]_vars
          /\ WF_vars(SystemWith(E1StartFinish, StartCancelled, DriverCancel))

\* E2 (defect 2): once the factory built the executor, start sets RUNNING
\* unconditionally (a bare assignment: the table has no (CLOSING, STARTED)),
\* so a close() during start does not stick.
E2StartFinish ==
    IF startPc = "await" /\ factory = "built"
    THEN /\ startPc' = "done" /\ eng' = "RUNNING" /\ owned' = TRUE /\ Silent
         /\ UNCHANGED <<stage, factory, exec, closePc, closedEvt, callPc, net, wk, cancelSent,
                        dataQ, ctrlQ, ioBusy>>
    ELSE StartFinish
E2Spec == Init /\ [][NextWith(E2StartFinish, StartCancelled, DriverCancel)]_vars

\* E3 (defect 3): start's cancel handler does not wait for the factory's
\* thread: it gives up at once, and the executor the thread builds later
\* (or built already, its result lost with the cancelled await) is nobody's.
E3StartCancelled ==
    /\ startPc = "cancelled"
    /\ startPc' = "done"
    /\ EngineFire("START_FAILED")
    /\ closedEvt' = (closedEvt \/ eng' \in EngineTerminal)
    /\ UNCHANGED <<stage, factory, exec, owned, closePc, callPc, net, wk, cancelSent, dataQ, ctrlQ, ioBusy>>
E3Spec == Init /\ [][NextWith(StartFinish, E3StartCancelled, DriverCancel)]_vars

\* E5 (defect 5): one I/O thread for everything: a cancel is queued behind
\* the data sends, so a send blocked on a full pipe starves every abort.
E5DriverCancel(r) ==
    /\ Ending(r) /\ net[r] = "sent" /\ OnWorker(r) /\ ~cancelSent[r]
    /\ cancelSent' = [cancelSent EXCEPT ![r] = TRUE]
    /\ dataQ' = Append(dataQ, [k |-> "cancel", r |-> r])
    /\ Silent
    /\ UNCHANGED <<eng, stage, startPc, factory, exec, owned, closePc, closedEvt, callPc, net, wk, ctrlQ, ioBusy>>
E5Spec == Init /\ [][NextWith(StartFinish, StartCancelled, E5DriverCancel)]_vars
          /\ WF_vars(SystemWith(StartFinish, StartCancelled, E5DriverCancel))
=============================================================================
