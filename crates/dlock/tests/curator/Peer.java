// A Curator client for dlock's interoperability tests (crates/dlock/tests/zookeeper_curator.rs).
//
// java Peer CONNECT KIND PATH PERMITS HOLD_MS
//   KIND: mutex (InterProcessMutex), read / write (InterProcessReadWriteLock),
//         semaphore (InterProcessSemaphoreV2 with PERMITS leases),
//         latch (a LeaderLatch with the id "curator-peer"; "held" = leader),
//         leader (prints "leader ID" of the current leader, or "leader none", and exits)
// Prints "ready" once connected, "held" once it holds, "released" after HOLD_MS, and
// "timeout" (exit 3) when it could not acquire within 30 s.
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.leader.LeaderLatch;
import org.apache.curator.framework.recipes.leader.Participant;
import org.apache.curator.framework.recipes.locks.InterProcessLock;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.retry.RetryNTimes;

public class Peer {
    static void say(String line) {
        System.out.println(line);
        System.out.flush();
    }

    public static void main(String[] args) throws Exception {
        String connect = args[0];
        String kind = args[1];
        String path = args[2];
        int permits = Integer.parseInt(args[3]);
        long holdMs = Long.parseLong(args[4]);
        CuratorFramework client =
            CuratorFrameworkFactory.newClient(connect, 10000, 5000, new RetryNTimes(3, 100));
        client.start();
        if (!client.blockUntilConnected(10, TimeUnit.SECONDS)) {
            say("no connection");
            System.exit(4);
        }
        say("ready");
        if (kind.equals("leader")) {
            Participant leader = new LeaderLatch(client, path, "observer").getLeader();
            say("leader " + (leader.isLeader() ? leader.getId() : "none"));
            client.close();
            return;
        }
        if (kind.equals("latch")) {
            LeaderLatch latch = new LeaderLatch(client, path, "curator-peer");
            latch.start();
            if (!latch.await(30, TimeUnit.SECONDS)) {
                say("timeout");
                System.exit(3);
            }
            say("held");
            Thread.sleep(holdMs);
            latch.close();
        } else if (kind.equals("semaphore")) {
            InterProcessSemaphoreV2 semaphore = new InterProcessSemaphoreV2(client, path, permits);
            Lease lease = semaphore.acquire(30, TimeUnit.SECONDS);
            if (lease == null) {
                say("timeout");
                System.exit(3);
            }
            say("held");
            Thread.sleep(holdMs);
            semaphore.returnLease(lease);
        } else {
            InterProcessLock lock;
            if (kind.equals("mutex")) {
                lock = new InterProcessMutex(client, path);
            } else if (kind.equals("read")) {
                lock = new InterProcessReadWriteLock(client, path).readLock();
            } else {
                lock = new InterProcessReadWriteLock(client, path).writeLock();
            }
            if (!lock.acquire(30, TimeUnit.SECONDS)) {
                say("timeout");
                System.exit(3);
            }
            say("held");
            Thread.sleep(holdMs);
            lock.release();
        }
        say("released");
        client.close();
    }
}
