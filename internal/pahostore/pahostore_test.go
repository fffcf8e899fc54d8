package pahostore

import (
	"fmt"
	"slices"
	"testing"

	"github.com/eclipse/paho.mqtt.golang/packets"
)

func TestGetReturnsACopyOfAPublish(t *testing.T) {
	s := New()
	s.Open()
	defer s.Close()
	p := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
	p.Qos, p.MessageID, p.TopicName, p.Payload = 1, 7, "a/b", []byte("x")
	s.Put("o.7", p)

	got := s.Get("o.7").(*packets.PublishPacket)
	if got == p {
		t.Fatal("Get returned the stored packet itself; want a copy")
	}
	got.Dup = true
	if p.Dup {
		t.Error("setting Dup on the copy changed the stored packet")
	}
	if got.TopicName != "a/b" || got.MessageID != 7 || string(got.Payload) != "x" {
		t.Errorf("copy = %+v; want the stored packet's content", got)
	}
	if s.Get("o.8") != nil {
		t.Error("Get of a missing key = non-nil")
	}
	sub := packets.NewControlPacket(packets.Subscribe)
	s.Put("o.9", sub)
	if s.Get("o.9") != sub {
		t.Error("non-PUBLISH packets are returned as stored")
	}
}

// The chosen outgoing PUBLISHes come back from the store unretained, as
// resume sends them again; every packet stays listed, so that resume takes
// back each one's packet id.
func TestResentUnretained(t *testing.T) {
	s := New().ResentUnretained(func(topic string) bool { return topic == "b/state" })
	s.Open()
	defer s.Close()
	pub := func(id uint16, topic string) *packets.PublishPacket {
		p := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
		p.Qos, p.MessageID, p.TopicName, p.Retain = 1, id, topic, true
		return p
	}
	s.Put("o.1", pub(1, "b/state"))
	s.Put("o.2", pub(2, "d/replies"))
	s.Put("i.3", pub(3, "b/state")) // incoming: paho's to acknowledge, as it came
	if got, want := s.All(), []string{"o.1", "o.2", "i.3"}; !slices.Equal(got, want) {
		t.Fatalf("All = %v; want %v", got, want)
	}
	for key, retained := range map[string]bool{"o.1": false, "o.2": true, "i.3": true} {
		p, ok := s.Get(key).(*packets.PublishPacket)
		if !ok || p.Retain != retained {
			t.Errorf("Get(%s) = %v; want a PUBLISH with retain %v", key, p, retained)
		}
	}
	if p := s.MemoryStore.Get("o.1").(*packets.PublishPacket); !p.Retain {
		t.Error("the stored packet lost its retain flag: Get must clear it on a copy")
	}
}

// All hands out the packets in the order they were put, whatever their
// keys (message ids wrap around), after deletes, and after a key is put
// again: resume sends again in publish order what it gets from All.
func TestAllIsInPutOrder(t *testing.T) {
	for _, unretained := range []bool{false, true} {
		s := New()
		if unretained {
			s.ResentUnretained(func(topic string) bool { return topic == "b/state" })
		}
		s.Open()
		var want []string
		for i := range 200 {
			// Ids from 65436 up, wrapping past 65535 to 1, as paho's do.
			id := uint16((65435+i)%65535 + 1)
			p := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
			p.Qos, p.MessageID, p.TopicName = 1, id, "d/commands"
			key := fmt.Sprintf("o.%d", id)
			s.Put(key, p)
			want = append(want, key)
			if i == 100 {
				st := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
				st.Qos, st.MessageID, st.TopicName = 1, 200, "b/state"
				s.Put("o.200", st)
				want = append(want, "o.200")
			}
		}
		for _, k := range []string{"o.65500", "o.3", "o.90"} {
			s.Del(k)
			want = slices.DeleteFunc(want, func(w string) bool { return w == k })
		}
		again := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
		again.Qos, again.MessageID, again.TopicName = 1, 3, "d/commands"
		s.Put("o.3", again) // the id freed and used again: the newest
		want = append(want, "o.3")
		if got := s.All(); !slices.Equal(got, want) {
			t.Errorf("All (ResentUnretained set: %v) = %v; want %v", unretained, got, want)
		}
		s.Reset()
		if got := s.All(); len(got) != 0 {
			t.Errorf("All after Reset = %v; want none", got)
		}
		s.Close()
	}
}
